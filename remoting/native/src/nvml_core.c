/* libnvidia-ml.so.1: initialisation, device handles and the queries answered locally. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* Event sets: a slice reports no events, so a set is a token that never fires. */
struct rgpu_nvml_event_set { uint32_t magic; };
#define NVML_EVENT_SET_MAGIC 0x4e564553u

RGPU_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    struct rgpu_nvml_event_set *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = NVML_EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set || set->magic != NVML_EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    free(set);
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                  nvmlEventSet_t set) {
    (void)eventTypes;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (!device_of(device) || !set || set->magic != NVML_EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (!device_of(device) || !eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = 0;
    return NVML_SUCCESS;
}

RGPU_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, void *data, unsigned int timeoutms) {
    (void)data;
    if (!set || set->magic != NVML_EVENT_SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    /* Wait out the timeout as the real call would, so a monitoring loop does not spin. */
    struct timespec ts = {(time_t)(timeoutms / 1000), (long)(timeoutms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    return NVML_ERROR_TIMEOUT;
}

static nvmlReturn_t device_zero(nvmlDevice_t device, unsigned int *out) {
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (!device_of(device) || !out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = 0;
    return NVML_SUCCESS;
}

/* A slice's handle is never a MIG device handle, holds no MIG devices, and is no vGPU
 * (NVML_GPU_VIRTUALIZATION_MODE_NONE is 0). */
RGPU_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    return device_zero(device, isMigDevice);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    return device_zero(device, count);
}
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetVirtualizationMode(nvmlDevice_t device, unsigned int *pVirtualMode) {
    return device_zero(device, pVirtualMode);
}

/* Two slices never reach each other's memory (they may sit on different servers):
 * NVML_P2P_STATUS_NOT_SUPPORTED (5) for every capability, as cuDeviceCanAccessPeer answers 0. */
RGPU_EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, int p2pIndex,
                                                int *p2pStatus) {
    if (!p2pStatus) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = check();
    if (r != NVML_SUCCESS) return r;
    if (!device_of(device1) || !device_of(device2) || p2pIndex < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *p2pStatus = 5;
    return NVML_SUCCESS;
}

/* nvmlTemperature_v1_t: {unsigned int version; nvmlTemperatureSensors_t sensorType; int temperature;}
 * with version = sizeof | 1 << 24. */
struct rgpu_nvml_temperature_v1 { unsigned int version; int sensorType; int temperature; };
#define NVML_TEMPERATURE_V1 ((unsigned int)(sizeof(struct rgpu_nvml_temperature_v1) | (1u << 24)))

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, void *temperature) {
    struct rgpu_nvml_temperature_v1 *t = temperature;
    if (!t) return NVML_ERROR_INVALID_ARGUMENT;
    if (t->version != NVML_TEMPERATURE_V1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    unsigned int value = 0;
    nvmlReturn_t r = nvmlDeviceGetTemperature(device, t->sensorType, &value);
    if (r == NVML_SUCCESS) t->temperature = (int)value;
    return r;
}

/* nvmlFieldValue_t (40 bytes): the caller fills fieldId and scopeId; NVML answers each entry
 * with its own nvmlReturn, value type and value, and the call itself succeeds. nvidia-smi -q
 * reads power readings this way and trusts the entries, so every entry gets an answer: the
 * GPU-scope power limits from the remoted limit calls, NVML_ERROR_NOT_SUPPORTED ("N/A") for
 * the rest, never stale memory. */
struct rgpu_nvml_field_value {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType, nvmlReturn;
    unsigned long long value;
};
enum { FI_POWER_MIN_LIMIT = 187, FI_POWER_MAX_LIMIT = 188, FI_POWER_DEFAULT_LIMIT = 189,
       FI_POWER_CURRENT_LIMIT = 190, VALUE_TYPE_UNSIGNED_INT = 1, POWER_SCOPE_GPU = 0 };

static nvmlReturn_t field_value(nvmlDevice_t device, const struct rgpu_nvml_field_value *f, unsigned int *out) {
    unsigned int min_limit = 0, max_limit = 0;
    nvmlReturn_t r;
    if (f->scopeId != POWER_SCOPE_GPU) return NVML_ERROR_NOT_SUPPORTED;
    switch (f->fieldId) {
    case FI_POWER_CURRENT_LIMIT: return nvmlDeviceGetPowerManagementLimit(device, out);
    case FI_POWER_DEFAULT_LIMIT: return nvmlDeviceGetPowerManagementDefaultLimit(device, out);
    case FI_POWER_MIN_LIMIT:
    case FI_POWER_MAX_LIMIT:
        r = nvmlDeviceGetPowerManagementLimitConstraints(device, &min_limit, &max_limit);
        *out = f->fieldId == FI_POWER_MIN_LIMIT ? min_limit : max_limit;
        return r;
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
}

RGPU_EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, void *values) {
    if (!device_of(device) || valuesCount < 0 || (valuesCount && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    struct rgpu_nvml_field_value *v = values;
    for (int i = 0; i < valuesCount; i++) {
        unsigned int value = 0;
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        v[i].nvmlReturn = field_value(device, &v[i], &value);
        v[i].timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        v[i].latencyUsec = 0;
        v[i].valueType = VALUE_TYPE_UNSIGNED_INT;
        v[i].value = value;
    }
    return NVML_SUCCESS;
}

/* nvidia-smi asks for a private table through nvmlInternalGetExportTable right after nvmlInit
 * and stops ("Mismatch in versions between nvidia-smi and NVML") without one. The layout is not
 * documented; what projects emulating NVML found for nvidia-smi 580: slot 0 holds the table's
 * size in bytes (it must exceed 648), the others are entry points called with device handles
 * that nvidia-smi got from us. Slot 81 looks a device up by index (index, nvmlDevice_t *out,
 * 0x22); slots 213-215 list a device's processes (device, unsigned *count in/out, entries).
 * rgpu answers the lookup and reports no processes (as nvmlDeviceGet*RunningProcesses do).
 * Other per-device slots return NVML_ERROR_NOT_SUPPORTED, which nvidia-smi -q shows as N/A
 * (answering "success" left their outputs unset: -q printed made-up values). Calls without one
 * of our device handles (slot 26, hundreds of times per -q) succeed without effect. Checked on
 * an H200 with driver 580.159.04: the default view, -L, -q and topo -m. Each slot has its own
 * trampoline, so the slot number, not a guess from the arguments, decides what a call means. */
#define INTERNAL_TABLE_SLOTS 256
#define SLOT_DEVICE_BY_INDEX 81
#define SLOT_PROCESSES_FIRST 213
#define SLOT_PROCESSES_LAST 215
#define DEVICE_BY_INDEX_MARK 0x22

static nvmlReturn_t internal_call(unsigned int slot, void *a0, void *a1, void *a2) {
    rgpu_log(RGPU_LOG_DEBUG, "nvidia-smi's internal table: slot %u (%p, %p, %p)", slot, a0, a1, a2);
    if (slot == SLOT_DEVICE_BY_INDEX && a1 && (uintptr_t)a2 == DEVICE_BY_INDEX_MARK &&
        (uintptr_t)a0 < (uintptr_t)RGPU_MAX_SESSIONS)
        return nvmlDeviceGetHandleByIndex_v2((unsigned int)(uintptr_t)a0, (nvmlDevice_t *)a1);
    if (!a1 || !device_of((nvmlDevice_t)a0)) return NVML_SUCCESS;
    if (slot < SLOT_PROCESSES_FIRST || slot > SLOT_PROCESSES_LAST) return NVML_ERROR_NOT_SUPPORTED;
    *(unsigned int *)a1 = 0;  /* no processes, as nvmlDeviceGet*RunningProcesses answer */
    return NVML_SUCCESS;
}

#define SLOT_DEFINE(hi, lo)                                                                     \
    static nvmlReturn_t internal_slot_##hi##_##lo(void *a0, void *a1, void *a2, void *a3) {      \
        (void)a3;                                                                               \
        return internal_call((hi) * 16 + (lo), a0, a1, a2);                                      \
    }
#define SLOT_ADDRESS(hi, lo) (void *)internal_slot_##hi##_##lo,
#define SLOT_ROW(M, hi) M(hi, 0) M(hi, 1) M(hi, 2) M(hi, 3) M(hi, 4) M(hi, 5) M(hi, 6) M(hi, 7)     \
    M(hi, 8) M(hi, 9) M(hi, 10) M(hi, 11) M(hi, 12) M(hi, 13) M(hi, 14) M(hi, 15)
#define SLOT_ALL(M) SLOT_ROW(M, 0) SLOT_ROW(M, 1) SLOT_ROW(M, 2) SLOT_ROW(M, 3) SLOT_ROW(M, 4)      \
    SLOT_ROW(M, 5) SLOT_ROW(M, 6) SLOT_ROW(M, 7) SLOT_ROW(M, 8) SLOT_ROW(M, 9) SLOT_ROW(M, 10)    \
    SLOT_ROW(M, 11) SLOT_ROW(M, 12) SLOT_ROW(M, 13) SLOT_ROW(M, 14) SLOT_ROW(M, 15)

SLOT_ALL(SLOT_DEFINE)

static void *g_internal_table[INTERNAL_TABLE_SLOTS] = {SLOT_ALL(SLOT_ADDRESS)};
static pthread_once_t g_internal_table_once = PTHREAD_ONCE_INIT;

static void internal_table_init(void) {
    g_internal_table[0] = (void *)(uintptr_t)sizeof(g_internal_table);  /* slot 0 is the size */
}

RGPU_EXPORT nvmlReturn_t nvmlInternalGetExportTable(const void **ppExportTable, const void *pExportTableId) {
    if (!ppExportTable || !pExportTableId) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_once(&g_internal_table_once, internal_table_init);
    *ppExportTable = g_internal_table;
    return NVML_SUCCESS;
}
