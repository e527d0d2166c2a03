/* A test double for a client descheduled between its connect and its HELLO (test_front_door.py):
 * preloaded into the client, the first RGPU_TEST_HELLO_LATE_TIMES (default 1) session HELLOs it
 * sends (send(2) of a frame with op HELLO whose flags lack HELLO_LANE; transport.c sends each frame
 * whole) wait RGPU_TEST_HELLO_LATE_MS milliseconds first, on a connection already open. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HEADER 24
#define OP_HELLO 1
#define HELLO_LANE 8

static int held;

ssize_t send(int fd, const void *p, size_t n, int flags) {
    static ssize_t (*real)(int, const void *, size_t, int);
    if (!real) real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    const char *ms = getenv("RGPU_TEST_HELLO_LATE_MS"), *times = getenv("RGPU_TEST_HELLO_LATE_TIMES");
    const uint8_t *b = p;
    uint16_t op;
    uint32_t hello_flags;
    if (ms && n >= HEADER + 12 && (memcpy(&op, b + 4, 2), op == OP_HELLO) && !memcmp(b + HEADER, "RGPU", 4) &&
        (memcpy(&hello_flags, b + HEADER + 8, 4), !(hello_flags & HELLO_LANE)) &&
        __atomic_add_fetch(&held, 1, __ATOMIC_SEQ_CST) <= (times ? atoi(times) : 1)) {
        long late = atol(ms);
        struct timespec t = {late / 1000, (late % 1000) * 1000000L};
        nanosleep(&t, NULL);
    }
    return real(fd, p, n, flags);
}
