/* Same-host page-locked memory read in place (protocol 15).
 *
 * When the application and its slice's worker run on one host (flexrun local, a Slurm job on a GPU
 * node), the pages of a zero-copy allocation (zero_copy.c: cuMemHostAlloc/cuMemAllocHost at an
 * address the worker reserved) are a memfd's, mapped MAP_SHARED here and, after the fd crossed the
 * worker's Unix socket with SCM_RIGHTS, in the worker too (on a GPU it registers them with
 * cuMemHostRegister). A copy from or to such memory then carries (region, offset, length) instead
 * of bytes: the worker's DMA reads or writes the application's own pages.
 *
 * Which sessions: the worker answers rgpuHostShare(0) with the abstract name of a socket it opened
 * for this session alone (a random name, known only through the session's connection), and this
 * process connects to it. That connect succeeds only on the worker's host (and network namespace):
 * a session to another host finds no such name and keeps its copies on the wire. The worker checks
 * the connecting process's uid against the session's, and maps only a sealed memfd of the size it
 * was told (remoting/datapath/worker/shared_pinned.py).
 *
 * Fork: the child keeps this process's pages as they were, privately: each region is mapped again
 * MAP_PRIVATE from its memfd (kept open, close-on-exec, for that), so the child's writes stay its
 * own and nothing is copied at fork. Unlike a fork of anonymous memory, a page the child has not
 * written still shows the parent's later writes. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "rgpu_client.h"

enum { LINK_UNKNOWN = 0, LINK_READY = 1, LINK_NONE = -1 };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;   /* one share at a time: fds and frames in step */
static int g_state[RGPU_MAX_SESSIONS];
static int g_fd[RGPU_MAX_SESSIONS];

static int enabled(void) {
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("RGPU_SHARED_PINNED");
        on = !(v && (!strcmp(v, "0") || !strcmp(v, "off") || !strcmp(v, "no")));
    }
    return on;
}

/* Allocations and copies below this many bytes stay as they were (RGPU_SHARED_MIN_BYTES): a small
 * copy's bytes cost less on the wire than a Python handler on the worker. */
size_t rgpu_shared_min_bytes(void) {
    static long long min = -1;
    if (min < 0) {
        const char *v = getenv("RGPU_SHARED_MIN_BYTES");
        char *end = NULL;
        long long n = v && *v ? strtoll(v, &end, 10) : -1;
        min = n >= 0 && end && !*end ? n : (256 << 10);
    }
    return (size_t)min;
}

static void say_not_shared(int session, const char *why) {
    static int seen;
    const char *same_host = getenv("RGPU_SAME_HOST");
    int expected = same_host && !strcmp(same_host, "1");
    if (!__atomic_exchange_n(&seen, 1, __ATOMIC_RELAXED))
        rgpu_log(expected ? RGPU_LOG_WARN : RGPU_LOG_INFO, "page-locked memory of device %d is not shared with its "
                 "GPU server's worker (%s); copies from and to it cross the socket", session, why);
}

/* Opens the session's shared-memory socket once; 1 when it is there. g_lock held. */
static int link_ready(int session) {
    if (session < 0 || session >= RGPU_MAX_SESSIONS) return 0;
    if (g_state[session] != LINK_UNKNOWN) return g_state[session] == LINK_READY;
    g_state[session] = LINK_NONE;
    rgpu_call c;
    if (rgpu_begin_session(&c, RGPU_OP_rgpuHostShare, session) != CUDA_SUCCESS) return 0;
    rgpu_put_u64(&c, 0);
    rgpu_put_u64(&c, 0);
    CUresult r = rgpu_sync(&c);
    char name[108];
    size_t n = r == CUDA_SUCCESS ? rgpu_remaining(&c) : 0;
    if (n && n < sizeof name) rgpu_get(&c, name, n);
    rgpu_end(&c);
    if (r != CUDA_SUCCESS || !n || n >= sizeof name) {
        say_not_shared(session, r == CUDA_ERROR_NOT_SUPPORTED ? "the worker does not offer it: RGPU_SHARED_PINNED=0 "
                       "there, or a backend without it" : "the worker did not answer with its socket");
        return 0;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path + 1, name, n);   /* abstract: sun_path[0] is 0 */
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n))) {
        char why[160];
        snprintf(why, sizeof why, "its socket is not reachable from here: %s; another host or network namespace",
                 strerror(errno));
        if (fd >= 0) close(fd);
        say_not_shared(session, why);
        return 0;
    }
    g_fd[session] = fd;
    g_state[session] = LINK_READY;
    rgpu_log(RGPU_LOG_INFO, "device %d: page-locked memory is shared with the worker (same host: copies from "
             "and to it are read and written in place)", session);
    return 1;
}

/* Passes memfd `fd` of `size` bytes to the worker and has it mapped: its region id, or 0. g_lock held. */
static uint64_t share(int session, int fd, size_t size) {
    uint64_t msg[2] = {size, 0};
    if (getrandom(&msg[1], sizeof msg[1], 0) != sizeof msg[1]) msg[1] = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {msg, sizeof msg};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    if (sendmsg(g_fd[session], &mh, MSG_NOSIGNAL) != (ssize_t)sizeof msg) {
        close(g_fd[session]);
        g_fd[session] = -1;
        g_state[session] = LINK_NONE;
        say_not_shared(session, "its socket broke");
        return 0;
    }
    rgpu_call c;
    if (rgpu_begin_session(&c, RGPU_OP_rgpuHostShare, session) != CUDA_SUCCESS) return 0;
    rgpu_put_u64(&c, size);
    rgpu_put_u64(&c, msg[1]);
    CUresult r = rgpu_sync(&c);
    uint64_t region = r == CUDA_SUCCESS ? rgpu_get_u64(&c) : 0;
    rgpu_end(&c);
    return region;
}

/* Maps `mapped` bytes at `at` (NULL: anywhere) from a memfd shared with the session's worker: the
 * address, with *region and *memfd set, or NULL with nothing mapped. */
void *rgpu_shared_pinned_map(int session, void *at, size_t mapped, uint64_t *region, int *memfd) {
    if (!enabled() || mapped < rgpu_shared_min_bytes()) return NULL;
    pthread_mutex_lock(&g_lock);
    void *out = NULL;
    if (link_ready(session)) {
        int fd = memfd_create("rgpu-pinned", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        /* Sealed against shrinking: the worker maps only such a memfd, which no one can cut short
         * under its mapping (a truncated file would fault the worker's reads). */
        if (fd >= 0 && !ftruncate(fd, (off_t)mapped) &&
            !fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
            void *p = mmap(at, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | (at ? MAP_FIXED_NOREPLACE : 0), fd, 0);
            if (p != MAP_FAILED && (!at || p == at)) {
                uint64_t id = share(session, fd, mapped);
                if (id) {
                    *region = id;
                    *memfd = fd;
                    out = p;
                } else {
                    munmap(p, mapped);
                }
            } else if (p != MAP_FAILED) {
                munmap(p, mapped);
            }
        }
        if (!out && fd >= 0) close(fd);
    }
    pthread_mutex_unlock(&g_lock);
    return out;
}

/* cuMemFreeHost of a shared region: the worker unmaps (and unregisters) it. */
CUresult rgpu_shared_pinned_unshare(int session, uint64_t region) {
    rgpu_call c;
    CUresult r = rgpu_begin_session(&c, RGPU_OP_rgpuHostUnshare, session);
    if (r != CUDA_SUCCESS) return r;
    rgpu_put_u64(&c, region);
    r = rgpu_sync(&c);
    rgpu_end(&c);
    return r;
}

/* In a forked child: the region's pages become the child's own, copy-on-write from the memfd. */
void rgpu_shared_pinned_privatize(void *base, size_t mapped, int memfd) {
    if (mmap(base, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, memfd, 0) == MAP_FAILED)
        rgpu_log(RGPU_LOG_WARN, "after fork: page-locked memory at %p stays shared with the parent (%s)", base,
                 strerror(errno));
    close(memfd);
}

/* After fork() the child has no sessions: its sockets to the parent's workers go. */
void rgpu_shared_pinned_reset_after_fork(void) {
    pthread_mutex_init(&g_lock, NULL);
    for (int i = 0; i < RGPU_MAX_SESSIONS; i++) {
        if (g_state[i] == LINK_READY) close(g_fd[i]);
        g_state[i] = LINK_UNKNOWN;
        g_fd[i] = -1;
    }
}
