/* libcuda.so.1: the driver's compute-cache table (private UUID da9151d3-3ae6-cc41-a5c0-4f26d533e328),
 * answered in this process with a per-user cache on the CPU node's disk.
 *
 * NVRTC keeps a cache of what it compiled, and reaches it through the driver: it loads
 * libcuda.so.1, asks cuGetExportTable for this table, and disables its cache when the table is
 * missing. Without it every process recompiles what cuDNN's runtime-fused engines generate
 * (ResNet-18's first training step: 15 s of CPU through rgpu against 1-6 s locally, the same as a
 * local run with CUDA_CACHE_DISABLE=1). The slots, as NVRTC 13 calls them (read from its call
 * sites; NVIDIA does not document the table):
 *   1 GenerateKey(void **key, int kind, const void *data, uint32_t size, const char *options,
 *                 const char *host, const char *build, int a, int b)   an opaque key
 *   2 FreeKey(void *key)
 *   3 Load(void *key, int flags, void **data, uint32_t *size)          0: found; data is ours
 *   4 Store(void *key, int flags, const void *data, uint32_t size)
 *   5 (never seen called: CUDA_ERROR_NOT_SUPPORTED)
 *   6 DeleteCacheData(void *data)                                      frees what Load gave
 * The key is a SHA-256 over every input, NVRTC's build stamp included, so a different NVRTC,
 * option or source never shares an entry. Entries are files named by key under the user's own
 * folder (CUDA_CACHE_PATH/rgpu-nvrtc, else $XDG_CACHE_HOME or ~/.cache /rgpu/compute-cache,
 * else $TMPDIR/rgpu-compute-cache-<uid>), mode 0700, refused when another user owns it or it is a
 * link; each file carries its data's digest, checked on load (a damaged entry is a miss and is
 * removed). CUDA_CACHE_DISABLE=1 turns the cache off; CUDA_CACHE_MAXSIZE (bytes, default 1 GiB)
 * bounds it, the oldest entries going first. Any failure is a miss: compiling again is always
 * correct.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "rgpu_sha256.h"

#define ENTRY_MAGIC "rgpu-cc1"
#define MAX_ENTRY_BYTES (256u << 20)
#define DEFAULT_MAX_BYTES (1ull << 30)

typedef struct cache_key { uint8_t digest[32]; } cache_key;

static int disabled(void) {
    const char *v = getenv("CUDA_CACHE_DISABLE");
    return v && *v && strcmp(v, "0") != 0;
}

/* A folder we own, made 0700 if missing; 0 when it cannot be used. */
static int own_folder(const char *path) {
    if (mkdir(path, 0700) != 0 && errno != EEXIST) return 0;
    struct stat st;
    return lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == getuid() && !(st.st_mode & 077);
}

static int make_parents(char *path) {   /* mkdir -p of path's parents, 0700 */
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        int ok = mkdir(path, 0700) == 0 || errno == EEXIST;
        *p = '/';
        if (!ok) return 0;
    }
    return 1;
}

/* The cache folder, chosen once per process; "" when none is usable. */
static const char *folder(void) {
    static char dir[4096];
    static int chosen;
    if (__atomic_load_n(&chosen, __ATOMIC_ACQUIRE)) return dir;
    char candidates[3][4096] = {{0}};
    const char *v;
    if ((v = getenv("CUDA_CACHE_PATH")) && *v) snprintf(candidates[0], sizeof candidates[0], "%s/rgpu-nvrtc", v);
    if ((v = getenv("XDG_CACHE_HOME")) && *v)
        snprintf(candidates[1], sizeof candidates[1], "%s/rgpu/compute-cache", v);
    else if ((v = getenv("HOME")) && *v)
        snprintf(candidates[1], sizeof candidates[1], "%s/.cache/rgpu/compute-cache", v);
    v = getenv("TMPDIR");
    snprintf(candidates[2], sizeof candidates[2], "%s/rgpu-compute-cache-%u", v && *v ? v : "/tmp", (unsigned)getuid());
    char found[4096] = "";
    for (int i = 0; i < 3 && !found[0]; i++) {
        if (!candidates[i][0]) continue;
        if (make_parents(candidates[i]) && own_folder(candidates[i])) snprintf(found, sizeof found, "%s", candidates[i]);
    }
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&lock);
    if (!chosen) {
        memcpy(dir, found, sizeof dir);
        if (!found[0]) rgpu_log(RGPU_LOG_INFO, "no usable folder for NVRTC's compilation cache (tried CUDA_CACHE_PATH, "
                                               "~/.cache and TMPDIR); runtime-compiled kernels are compiled in every process");
        __atomic_store_n(&chosen, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&lock);
    return dir;
}

static void entry_path(char *out, size_t cap, const char *dir, const cache_key *k, int flags) {
    char hex[65];
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", k->digest[i]);
    snprintf(out, cap, "%s/%s-%d", dir, hex, flags);
}

static size_t text_len(const char *s) { return s ? strlen(s) + 1 : 0; }

/* ------------------------------------------------------------------ the slots */

static CUresult CUDAAPI generate_key(void **key, int kind, const void *data, uint32_t size, const char *options,
                                     const char *host, const char *build, int a, int b) {
    if (!key || (!data && size)) return CUDA_ERROR_INVALID_VALUE;
    static const char domain[] = "rgpu compute cache 1";
    size_t lens[3] = {text_len(options), text_len(host), text_len(build)};
    size_t total = sizeof domain + 3 * sizeof(int) + sizeof size + size + lens[0] + lens[1] + lens[2] + 3 * sizeof(size_t);
    uint8_t *buf = malloc(total), *p = buf;
    cache_key *k = malloc(sizeof *k);
    if (!buf || !k) {
        free(buf);
        free(k);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    int ints[3] = {kind, a, b};
    memcpy(p, domain, sizeof domain), p += sizeof domain;
    memcpy(p, ints, sizeof ints), p += sizeof ints;
    memcpy(p, &size, sizeof size), p += sizeof size;
    if (size) memcpy(p, data, size), p += size;
    const char *texts[3] = {options, host, build};
    for (int i = 0; i < 3; i++) {   /* each with its length, so fields never run together */
        memcpy(p, &lens[i], sizeof lens[i]), p += sizeof lens[i];
        if (lens[i]) memcpy(p, texts[i], lens[i]), p += lens[i];
    }
    rgpu_sha256(buf, (size_t)(p - buf), k->digest);
    free(buf);
    *key = k;
    return CUDA_SUCCESS;
}

static CUresult CUDAAPI free_key(void *key) {
    free(key);
    return CUDA_SUCCESS;
}

/* Entry file: magic (8), u64 size, sha256(data) (32), data. */
static CUresult CUDAAPI load(void *key, int flags, void **data, uint32_t *size) {
    if (!key || !data || !size) return CUDA_ERROR_INVALID_VALUE;
    *data = NULL;
    *size = 0;
    const char *dir = disabled() ? "" : folder();
    if (!dir[0]) return CUDA_ERROR_NOT_FOUND;
    char path[4200];
    entry_path(path, sizeof path, dir, key, flags);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return CUDA_ERROR_NOT_FOUND;
    uint8_t head[48];
    uint64_t n = 0;
    uint8_t *out = NULL;
    int ok = read(fd, head, sizeof head) == (ssize_t)sizeof head && !memcmp(head, ENTRY_MAGIC, 8);
    if (ok) {
        memcpy(&n, head + 8, 8);
        ok = n <= MAX_ENTRY_BYTES && (out = malloc(n ? n : 1)) != NULL;
    }
    for (uint64_t got = 0; ok && got < n;) {
        ssize_t r = read(fd, out + got, n - got);
        if (r <= 0) ok = 0;
        else got += (uint64_t)r;
    }
    close(fd);
    uint8_t digest[32];
    if (ok) {
        rgpu_sha256(out, n, digest);
        ok = !memcmp(digest, head + 16, 32);
    }
    if (!ok) {   /* damaged or foreign: a miss, and out of the way of the next store */
        free(out);
        unlink(path);
        return CUDA_ERROR_NOT_FOUND;
    }
    utimensat(AT_FDCWD, path, NULL, 0);   /* recently used: kept longest */
    *data = out;
    *size = (uint32_t)n;
    return CUDA_SUCCESS;
}

static CUresult CUDAAPI delete_data(void *data) {
    free(data);
    return CUDA_SUCCESS;
}

static uint64_t max_bytes(void) {
    const char *v = getenv("CUDA_CACHE_MAXSIZE");
    char *end;
    unsigned long long n = v && *v ? strtoull(v, &end, 10) : 0;
    return v && *v && *end == 0 && n ? (uint64_t)n : DEFAULT_MAX_BYTES;
}

/* Oldest entries out until the folder holds at most `limit` bytes. */
static void trim(const char *dir, uint64_t limit) {
    DIR *d = opendir(dir);
    if (!d) return;
    uint64_t total = 0;
    for (;;) {
        struct dirent *e;
        char oldest[4200] = "";
        time_t oldest_t = 0;
        total = 0;
        rewinddir(d);
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            char path[4200];
            struct stat st;
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
            total += (uint64_t)st.st_size;
            if (!oldest[0] || st.st_mtime < oldest_t) {
                oldest_t = st.st_mtime;
                snprintf(oldest, sizeof oldest, "%s", path);
            }
        }
        if (total <= limit || !oldest[0] || unlink(oldest) != 0) break;
    }
    closedir(d);
}

static CUresult CUDAAPI store(void *key, int flags, const void *data, uint32_t size) {
    if (!key || (!data && size)) return CUDA_ERROR_INVALID_VALUE;
    const char *dir = disabled() ? "" : folder();
    if (!dir[0] || size > MAX_ENTRY_BYTES) return CUDA_ERROR_NOT_SUPPORTED;
    uint64_t limit = max_bytes();
    if ((uint64_t)size + 48 > limit) return CUDA_ERROR_NOT_SUPPORTED;
    char path[4200], tmp[4300];
    entry_path(path, sizeof path, dir, key, flags);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return CUDA_ERROR_NOT_SUPPORTED;
    uint8_t head[48];
    uint64_t n = size;
    memcpy(head, ENTRY_MAGIC, 8);
    memcpy(head + 8, &n, 8);
    rgpu_sha256(data, size, head + 16);
    int ok = write(fd, head, sizeof head) == (ssize_t)sizeof head;
    for (uint32_t put = 0; ok && put < size;) {
        ssize_t w = write(fd, (const uint8_t *)data + put, size - put);
        if (w <= 0) ok = 0;
        else put += (uint32_t)w;
    }
    ok = close(fd) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {   /* a full disk: no entry, nothing half-written */
        unlink(tmp);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    trim(dir, limit);
    return CUDA_SUCCESS;
}

static CUresult CUDAAPI slot5(void) {
    static int seen;
    if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
        rgpu_log(RGPU_LOG_DEBUG, "slot 5 of the driver's compute-cache table called; rgpu does not implement it");
    return CUDA_ERROR_NOT_SUPPORTED;
}

const void *const rgpu_compute_cache_table[7] = {
    (void *)(7 * sizeof(void *)), (void *)generate_key, (void *)free_key, (void *)load, (void *)store,
    (void *)slot5, (void *)delete_data,
};
