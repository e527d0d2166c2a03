/* SHA-256 digests of module images that lie in read-only mappings of files, remembered across
 * processes. cudart registers every fatbin of the application's libraries at start-up (about 5 GB
 * for PyTorch 2.11 with cuDNN and cuBLAS), and each is named by its SHA-256 before it is loaded
 * (cuda_module.c): hashing them cost every PyTorch process about 5 s. An image inside a
 * read-only mapping of a regular file is the file's bytes at an offset; its digest is a function
 * of the file's identity (device, inode, size, mtime), the offset and the length, which is what a
 * record keys it by.
 *
 * The records live in $RGPU_DIGEST_MEMO, else $XDG_CACHE_HOME/rgpu/image-digests, else
 * ~/.cache/rgpu/image-digests (0600, the user's own): fixed 88-byte records appended with
 * O_APPEND, each with a check word, read once per process. A damaged or torn record is skipped
 * (the reader finds the next good one);
 * a file that cannot be read or written only means hashing as before (never an error). Images in
 * anonymous or writable memory (NVRTC output, buffers the application fills) are always hashed. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "rgpu_sha256.h"

#define MEMO_MAGIC 0x31474944555052ull   /* "RPUDIG1" */
#define MEMO_MAX_RECORDS (1u << 16)       /* past this the file starts again (stale libraries) */

typedef struct {
    uint64_t dev, ino, file_size, mtime_ns, offset, size;
    uint8_t digest[32];
    uint64_t check;   /* MEMO_MAGIC mixed with the fields above: torn or foreign records fail it */
} memo_record;

_Static_assert(sizeof(memo_record) == 88, "memo records are 88 bytes on disk");

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static memo_record *g_records;
static size_t g_count, g_cap;
static int g_loaded, g_disabled;
static char g_path[4096];

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xBF58476D1CE4E5B9ull;
}

static uint64_t record_check(const memo_record *r) {
    uint64_t h = MEMO_MAGIC;
    h = mix(h, r->dev);
    h = mix(h, r->ino);
    h = mix(h, r->file_size);
    h = mix(h, r->mtime_ns);
    h = mix(h, r->offset);
    h = mix(h, r->size);
    for (int i = 0; i < 32; i += 8) {
        uint64_t w;
        memcpy(&w, r->digest + i, 8);
        h = mix(h, w);
    }
    return h;
}

static int memo_path(void) {
    const char *explicit_path = getenv("RGPU_DIGEST_MEMO");
    if (explicit_path) {
        if (!*explicit_path) return -1;   /* set empty: off */
        snprintf(g_path, sizeof g_path, "%s", explicit_path);
        return 0;
    }
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    char dir[4000];
    if (xdg && *xdg) snprintf(dir, sizeof dir, "%s/rgpu", xdg);
    else if (home && *home) snprintf(dir, sizeof dir, "%s/.cache/rgpu", home);
    else return -1;
    /* The folder may not exist yet; an unwritable home leaves the memo off (hashing as before). */
    char parent[4000];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = 0;
        mkdir(parent, 0700);
    }
    mkdir(dir, 0700);
    snprintf(g_path, sizeof g_path, "%s/image-digests", dir);
    return 0;
}

static void add_record(const memo_record *r) {
    if (g_count == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 256;
        memo_record *grown = realloc(g_records, cap * sizeof *grown);
        if (!grown) return;
        g_records = grown;
        g_cap = cap;
    }
    g_records[g_count++] = *r;
}

/* Read the records once per process (the lock is held). */
static void load_records(void) {
    g_loaded = 1;
    if (memo_path() != 0) {
        g_disabled = 1;
        return;
    }
    int fd = open(g_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
        (size_t)st.st_size <= (size_t)MEMO_MAX_RECORDS * sizeof(memo_record)) {
        /* Read whole and scan: past a torn or damaged record, the next good one is found again. */
        size_t n = (size_t)st.st_size, have = 0;
        uint8_t *bytes = malloc(n ? n : 1);
        while (bytes && have < n) {
            ssize_t k = read(fd, bytes + have, n - have);
            if (k <= 0) break;
            have += (size_t)k;
        }
        for (size_t at = 0; bytes && at + sizeof(memo_record) <= have;) {
            memo_record r;
            memcpy(&r, bytes + at, sizeof r);
            if (r.check == record_check(&r)) {
                add_record(&r);
                at += sizeof r;
            } else {
                at++;
            }
        }
        free(bytes);
    } else if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid()) {
        unlink(g_path);   /* grown past its bound: start again */
    }
    close(fd);
}

/* The file identity and offset of [image, image + size) if it lies in one read-only mapping of a
 * regular file that is still the file at its path; 0 if not. */
static int image_origin(const void *image, size_t size, memo_record *key) {
    FILE *maps = fopen("/proc/self/maps", "re");
    if (!maps) return 0;
    uintptr_t at = (uintptr_t)image;
    char line[4096 + 256];
    int found = 0;
    while (fgets(line, sizeof line, maps)) {
        unsigned long start, end, offset, inode;
        unsigned int major, minor;
        char perms[8];
        int path_at = 0;
        if (sscanf(line, "%lx-%lx %7s %lx %x:%x %lu %n", &start, &end, perms, &offset, &major, &minor, &inode,
                   &path_at) < 7)
            continue;
        if (at < start || at >= end) continue;
        if (at + size > end || size > end - start || perms[1] != '-' || inode == 0 || !path_at || line[path_at] != '/')
            break;   /* writable, anonymous or cut across mappings: hash it */
        char *path = line + path_at;
        path[strcspn(path, "\n")] = 0;
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_ino != (ino_t)inode) break;   /* replaced since */
        key->dev = (uint64_t)st.st_dev;
        key->ino = (uint64_t)st.st_ino;
        key->file_size = (uint64_t)st.st_size;
        key->mtime_ns = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
        key->offset = (uint64_t)offset + (uint64_t)(at - start);
        key->size = size;
        found = 1;
        break;
    }
    fclose(maps);
    return found;
}

static int same_key(const memo_record *a, const memo_record *b) {
    return a->dev == b->dev && a->ino == b->ino && a->file_size == b->file_size && a->mtime_ns == b->mtime_ns &&
           a->offset == b->offset && a->size == b->size;
}

int rgpu_image_digest(const void *image, size_t size, uint8_t digest[32]) {
    memo_record key;
    memset(&key, 0, sizeof key);
    pthread_mutex_lock(&g_lock);
    if (!g_loaded) load_records();
    int usable = !g_disabled;
    pthread_mutex_unlock(&g_lock);
    int known_origin = usable && image_origin(image, size, &key);
    if (known_origin) {
        pthread_mutex_lock(&g_lock);
        for (size_t i = g_count; i-- > 0;) {
            if (same_key(&g_records[i], &key)) {
                memcpy(digest, g_records[i].digest, 32);
                pthread_mutex_unlock(&g_lock);
                return 0;
            }
        }
        pthread_mutex_unlock(&g_lock);
    }
    rgpu_sha256(image, size, digest);
    if (!known_origin) return 1;
    memcpy(key.digest, digest, 32);
    key.check = record_check(&key);
    pthread_mutex_lock(&g_lock);
    add_record(&key);
    int fd = open(g_path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (write(fd, &key, sizeof key) != (ssize_t)sizeof key) { /* a torn record fails its check */ }
        close(fd);
    }
    pthread_mutex_unlock(&g_lock);
    return 1;
}
