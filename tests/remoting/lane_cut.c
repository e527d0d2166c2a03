/* A test double for a data lane whose connection breaks mid-copy (test_lanes_emulated.py): preloaded
 * into the client, the RGPU_TEST_CUT_SENDMSG-th sendmsg(2) call (lanes.c sends every chunk with
 * sendmsg; nothing else in the client does) shuts its socket down and fails with ECONNRESET. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>

static int calls;

ssize_t sendmsg(int fd, const struct msghdr *m, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real) real = (ssize_t (*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    const char *v = getenv("RGPU_TEST_CUT_SENDMSG");
    int cut = v ? atoi(v) : 0;
    if (cut && __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST) == cut) {
        shutdown(fd, SHUT_RDWR);
        errno = ECONNRESET;
        return -1;
    }
    return real(fd, m, flags);
}
