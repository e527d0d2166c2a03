/* libnvidia-ml.so.1: initialisation, device handles and the queries answered locally. */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>

#include "rgpu_nvml_client.h"
#include "nvml_protos.h"

struct rgpu_nvml_device { uint32_t magic; int index; };
#define NVML_DEV_MAGIC 0x4e564d4cu

static struct rgpu_nvml_device g_devs[RGPU_MAX_SESSIONS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_connected;        /* sessions were opened (they stay open until exit) */
static int g_refs;             /* nvmlInit minus nvmlShutdown calls */
static nvmlReturn_t g_connect_result = NVML_ERROR_UNINITIALIZED;

static nvmlReturn_t from_cuda(CUresult r) {
    switch (r) {
    case CUDA_SUCCESS: return NVML_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: return NVML_ERROR_DRIVER_NOT_LOADED;
    default: return NVML_ERROR_GPU_IS_LOST;
    }
}

static nvmlReturn_t init(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_connected) {
        g_connect_result = from_cuda(rgpu_connect_all(RGPU_HELLO_NVML, "nvml"));
        for (int i = 0; i < RGPU_MAX_SESSIONS; i++) g_devs[i] = (struct rgpu_nvml_device){NVML_DEV_MAGIC, i};
        g_connected = 1;
    }
    if (g_connect_result == NVML_SUCCESS) g_refs++;
    nvmlReturn_t r = g_connect_result;
    pthread_mutex_unlock(&g_lock);
    return r;
}

static nvmlReturn_t check(void) { return g_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED; }

RGPU_EXPORT nvmlReturn_t nvmlInit_v2(void) { return init(); }
RGPU_EXPORT nvmlReturn_t nvmlInit(void) { return init(); }
RGPU_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init(); }

RGPU_EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = g_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_refs > 0) g_refs--;
    pthread_mutex_unlock(&g_lock);
    return r;
}

RGPU_EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t rgpu_nvml_unsupported(const char *name, int *seen) {
    if (!__atomic_exchange_n(seen, 1, __ATOMIC_RELAXED))
        rgpu_log(RGPU_LOG_INFO, "%s is not remoted (it returns NVML_ERROR_NOT_SUPPORTED)", name);
    return NVML_ERROR_NOT_SUPPORTED;
}

static struct rgpu_nvml_device *device_of(nvmlDevice_t d) {
    struct rgpu_nvml_device *x = (struct rgpu_nvml_device *)d;
    if (!x || x < g_devs || x >= g_devs + RGPU_MAX_SESSIONS || x->magic != NVML_DEV_MAGIC ||
        x->index >= rgpu_session_count)
        return NULL;
    return x;
}

nvmlReturn_t rgpu_nvml_begin(rgpu_call *c, uint16_t op) {
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    return rgpu_begin_session(c, op, 0) == CUDA_SUCCESS ? NVML_SUCCESS : NVML_ERROR_GPU_IS_LOST;
}

nvmlReturn_t rgpu_nvml_begin_dev(rgpu_call *c, uint16_t op, nvmlDevice_t device) {
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    struct rgpu_nvml_device *d = device_of(device);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    return rgpu_begin_session(c, op, d->index) == CUDA_SUCCESS ? NVML_SUCCESS : NVML_ERROR_GPU_IS_LOST;
}

nvmlReturn_t rgpu_nvml_sync(rgpu_call *c) {
    CUresult r = rgpu_sync(c);
    /* A broken session yields a CUDA code from the transport, not an NVML one. */
    return c->s->dead ? NVML_ERROR_GPU_IS_LOST : (nvmlReturn_t)r;
}

nvmlDevice_t rgpu_nvml_device_out(rgpu_call *c, uint32_t remote) {
    (void)remote;
    return (nvmlDevice_t)&g_devs[c->s->index];
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r == NVML_SUCCESS) *deviceCount = (unsigned int)rgpu_session_count;
    return r;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (index >= (unsigned int)rgpu_session_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&g_devs[index];
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    for (int i = 0; i < rgpu_session_count; i++) {
        char u[96];
        if (nvmlDeviceGetUUID((nvmlDevice_t)&g_devs[i], u, sizeof u) == NVML_SUCCESS && !strcmp(u, uuid)) {
            *device = (nvmlDevice_t)&g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    if (!pciBusId || !device) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    for (int i = 0; i < rgpu_session_count; i++) {
        nvmlPciInfo_t pci;
        if (nvmlDeviceGetPciInfo_v3((nvmlDevice_t)&g_devs[i], &pci) == NVML_SUCCESS &&
            !strcasecmp(pci.busId, pciBusId)) {
            *device = (nvmlDevice_t)&g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    struct rgpu_nvml_device *d = device_of(device);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)d->index;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    return nvmlDeviceGetIndex(device, minorNumber);
}

RGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    int v = RGPU_CUDA_VERSION;
    for (int i = 0; i < rgpu_session_count; i++)
        if (rgpu_sessions[i].driver_version > 0 && rgpu_sessions[i].driver_version < v) v = rgpu_sessions[i].driver_version;
    *cudaDriverVersion = v;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion);
}

RGPU_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    if (!version || !length) return NVML_ERROR_INVALID_ARGUMENT;
    char driver[80];
    nvmlReturn_t r = nvmlSystemGetDriverVersion(driver, sizeof driver);
    if (r != NVML_SUCCESS) return r;
    int cuda = 0;
    nvmlSystemGetCudaDriverVersion_v2(&cuda);
    int n = snprintf(version, length, "%d.%s", cuda / 1000, driver);
    return n < (int)length ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
}

/* Processes: the application's GPU work runs in workers on the GPU node, whose process IDs
 * mean nothing here. Report none rather than foreign PIDs. */
static nvmlReturn_t no_processes(nvmlDevice_t device, unsigned int *infoCount) {
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (!device_of(device)) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = 0;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *n, void *infos) {
    (void)infos;
    return no_processes(d, n);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, void *infos) {
    (void)infos;
    return no_processes(d, n);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *infos) {
    (void)infos;
    return no_processes(d, n);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *infos) {
    (void)infos;
    return no_processes(d, n);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, void *infos) {
    (void)infos;
    return no_processes(d, n);
}

RGPU_EXPORT nvmlReturn_t nvmlUnitGetCount(unsigned int *unitCount) {
    if (!unitCount) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r == NVML_SUCCESS) *unitCount = 0;
    return r;
}

RGPU_EXPORT nvmlReturn_t nvmlInternalGetExportTable(const void **ppExportTable, const void *pExportTableId) {
    (void)pExportTableId;
    if (ppExportTable) *ppExportTable = NULL;
    return NVML_ERROR_NOT_SUPPORTED;
}
