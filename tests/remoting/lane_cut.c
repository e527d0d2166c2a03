/* A test double for a data lane whose connection breaks mid-copy (test_lanes_emulated.py): preloaded
 * into the client, the RGPU_TEST_CUT_SENDMSG-th sendmsg(2) call (lanes.c sends every chunk with
 * sendmsg; nothing else in the client does), or the RGPU_TEST_CUT_RECV-th recv(2) with MSG_DONTWAIT
 * (lanes.c's receives; the session's connection is read without it), shuts its socket down and fails
 * with ECONNRESET. RGPU_TEST_SLOW_SENDMSG_US=N: every sendmsg(2) waits N microseconds first (a slow
 * network: a copy's lanes are still sending when the program goes on). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

static int calls, recvs;

ssize_t recv(int fd, void *p, size_t n, int flags) {
    static ssize_t (*real)(int, void *, size_t, int);
    if (!real) real = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    const char *v = getenv("RGPU_TEST_CUT_RECV");
    int cut = v ? atoi(v) : 0;
    if (cut && (flags & MSG_DONTWAIT) && __atomic_add_fetch(&recvs, 1, __ATOMIC_SEQ_CST) == cut) {
        shutdown(fd, SHUT_RDWR);
        errno = ECONNRESET;
        return -1;
    }
    return real(fd, p, n, flags);
}

ssize_t sendmsg(int fd, const struct msghdr *m, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real) real = (ssize_t (*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    const char *slow = getenv("RGPU_TEST_SLOW_SENDMSG_US");
    if (slow) usleep((useconds_t)atoi(slow));
    const char *v = getenv("RGPU_TEST_CUT_SENDMSG");
    int cut = v ? atoi(v) : 0;
    if (cut && __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST) == cut) {
        shutdown(fd, SHUT_RDWR);
        errno = ECONNRESET;
        return -1;
    }
    return real(fd, m, flags);
}
