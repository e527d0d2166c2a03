/* The NVML ABI that rgpu's libnvidia-ml.so.1 implements, written out by hand (no nvml.h on
 * CPU-only nodes). Struct layouts match nvml.h; nvidia-ml-py declares the same ones. */
#ifndef RGPU_NVML_H
#define RGPU_NVML_H

#include <stdint.h>

typedef int nvmlReturn_t;
typedef struct rgpu_nvml_device *nvmlDevice_t;
typedef struct rgpu_nvml_event_set *nvmlEventSet_t;
typedef int nvmlTemperatureSensors_t, nvmlClockType_t, nvmlClockId_t, nvmlPstates_t, nvmlEnableState_t,
    nvmlComputeMode_t, nvmlBrandType_t, nvmlMemoryErrorType_t, nvmlEccCounterType_t,
    nvmlTemperatureThresholds_t, nvmlPcieUtilCounter_t, nvmlInforomObject_t, nvmlGpuOperationMode_t;
typedef unsigned int nvmlDeviceArchitecture_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned long long bar1Total, bar1Free, bar1Used; } nvmlBAR1Memory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct {
    unsigned int version, domain, bus, device, pciDeviceId, pciSubSystemId, baseClass, subClass;
    char busId[32];
} nvmlPciInfoExt_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlPciInfoExt_t) == 64, "nvmlPciInfoExt_t layout");

#endif
