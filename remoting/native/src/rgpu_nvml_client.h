/* libnvidia-ml.so.1 internals: NVML calls over rgpu sessions of their own (HELLO_NVML). */
#ifndef RGPU_NVML_CLIENT_H
#define RGPU_NVML_CLIENT_H

#include "rgpu_client.h"
#include "rgpu_nvml.h"

nvmlReturn_t rgpu_nvml_begin(rgpu_call *c, uint16_t op);
nvmlReturn_t rgpu_nvml_begin_dev(rgpu_call *c, uint16_t op, nvmlDevice_t device);
nvmlReturn_t rgpu_nvml_sync(rgpu_call *c);
nvmlReturn_t rgpu_nvml_unsupported(const char *name, int *seen);
nvmlDevice_t rgpu_nvml_device_out(rgpu_call *c, uint32_t remote);

#endif
