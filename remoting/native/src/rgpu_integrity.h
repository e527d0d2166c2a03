/* The CUDA runtime's integrity check: the digest's inputs and the digest (integrity.c), shared by
 * the client library (cuda_export.c) and the trace library (trace.c). */
#ifndef RGPU_INTEGRITY_H
#define RGPU_INTEGRITY_H

#include <stdint.h>

#pragma pack(push, 1)
typedef struct integrity_input {
    uint32_t driver_version, version, pid, tid;
    uint64_t cudart_table, integrity_table, fn_address, unix_seconds;
} integrity_input;
typedef struct integrity_device { uint8_t uuid[16]; int32_t pci_domain, pci_bus, pci_device; } integrity_device;
#pragma pack(pop)

/* MD2-based digest over one integrity_input and `ndevices` integrity_device records. */
__attribute__((visibility("hidden"))) void rgpu_integrity_digest(const void *input48, const void *devices,
                                                                  unsigned int ndevices, uint64_t out[2]);

#endif
