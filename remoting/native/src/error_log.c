/* CUDA's error log management (cuLogs*, CUDA 12.9+), answered in the client: the log holds rgpu's
 * own lines, warnings and errors, the worker's explanations included (why an allocation, a load or
 * a launch was refused), so an application that registers a callback or dumps the log (PyTorch
 * 2.14 registers one at start-up) gets them beside the error code. NVIDIA's driver logs on the GPU
 * node are not forwarded.
 *
 * The log is a ring of the latest lines, at most LOG_BYTES (the driver's own bound, 25,600 bytes);
 * an iterator is the sequence number of the next line. A dump that starts before the oldest line
 * kept says how many were lost. Lines look like the driver's: "[time][tid][rgpu][E] message".
 * Callbacks run on a thread of their own, in order: a line is often written while the client holds
 * a session's lock, and a callback that called CUDA there would wait for itself. CUDA_LOG_FILE
 * (stdout or a file's path; the lines are on stderr already) gets each line too, as the driver's. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "rgpu_client.h"
#include "cuda_protos.h"

#define LOG_BYTES 25600u
#define MAX_LINES 512u
#define MAX_CALLBACKS 32u

typedef struct {
    char *text;        /* "[..][..][rgpu][E] message\n" */
    size_t len;
    size_t head;       /* where the message starts */
    int level;         /* RGPU_LOG_ERROR or RGPU_LOG_WARN */
} log_line;

typedef struct {
    CUlogsCallback fn;
    void *data;
    unsigned long id;  /* 0: free */
} log_callback;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static log_line g_lines[MAX_LINES];      /* line n is g_lines[n % MAX_LINES] */
static unsigned int g_first, g_next;     /* sequence numbers: the oldest kept, the next to write */
static size_t g_bytes;
static log_callback g_callbacks[MAX_CALLBACKS];
static unsigned long g_next_id = 1;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static unsigned int g_delivered;         /* the next line the callbacks' thread hands out */
static int g_thread_started;
static pthread_t g_thread;
static int g_calling;                    /* the callbacks' thread is running callbacks */
static pthread_cond_t g_called = PTHREAD_COND_INITIALIZER;

static void drop_oldest_locked(void) {
    log_line *l = &g_lines[g_first % MAX_LINES];
    g_bytes -= l->len;
    free(l->text);
    l->text = NULL;
    l->len = 0;
    g_first++;
}

/* CUDA_LOG_FILE: stdout, or a file appended to (one write per line); stderr has the lines already. */
static void log_to_file(const char *text, size_t len) {
    static int fd = -2;
    if (fd == -2) {
        const char *where = getenv("CUDA_LOG_FILE");
        fd = !where || !*where || !strcmp(where, "stderr") ? -1 : !strcmp(where, "stdout") ? 1
             : open(where, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    }
    if (fd >= 0) {
        ssize_t ignored = write(fd, text, len);
        (void)ignored;
    }
}

void rgpu_error_log_add(int level, const char *message, size_t n) {
    while (n && (message[n - 1] == '\n' || message[n - 1] == 0)) n--;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    localtime_r(&tv.tv_sec, &tm);
    char head[64];
    int h = snprintf(head, sizeof head, "[%02d:%02d:%02d.%03ld][%ld][rgpu][%c] ", tm.tm_hour, tm.tm_min, tm.tm_sec,
                     (long)(tv.tv_usec / 1000), (long)syscall(SYS_gettid), level == RGPU_LOG_ERROR ? 'E' : 'W');
    if (h < 0) return;
    if ((size_t)h + n + 1 > LOG_BYTES) n = LOG_BYTES - (size_t)h - 1;
    char *text = malloc((size_t)h + n + 2);
    if (!text) return;
    memcpy(text, head, (size_t)h);
    memcpy(text + h, message, n);
    text[(size_t)h + n] = '\n';
    text[(size_t)h + n + 1] = 0;
    size_t len = (size_t)h + n + 1;

    log_to_file(text, len);
    pthread_mutex_lock(&g_lock);
    while (g_next - g_first == MAX_LINES || (g_next != g_first && g_bytes + len > LOG_BYTES)) drop_oldest_locked();
    g_lines[g_next % MAX_LINES] = (log_line){text, len, (size_t)h, level};
    g_next++;
    g_bytes += len;
    if (g_thread_started) pthread_cond_signal(&g_wake);
    pthread_mutex_unlock(&g_lock);
}

/* The callbacks' thread: each new line, to every callback registered when it is handed out. */
static void *deliver(void *unused) {
    (void)unused;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        while (g_delivered == g_next) pthread_cond_wait(&g_wake, &g_lock);
        if ((int)(g_first - g_delivered) > 0) g_delivered = g_first;   /* overwritten before their turn */
        const log_line *l = &g_lines[g_delivered % MAX_LINES];
        g_delivered++;
        /* The message alone (as the driver hands it), in a copy that is the callbacks' to read. */
        size_t n = l->len - l->head - 1;
        char *copy = malloc(n + 1);
        CUlogLevel level = l->level == RGPU_LOG_ERROR ? CU_LOG_LEVEL_ERROR : CU_LOG_LEVEL_WARNING;
        log_callback calls[MAX_CALLBACKS];
        unsigned int ncalls = 0;
        for (unsigned int i = 0; i < MAX_CALLBACKS; i++)
            if (g_callbacks[i].id) calls[ncalls++] = g_callbacks[i];
        if (!copy) continue;
        memcpy(copy, l->text + l->head, n);
        copy[n] = 0;
        g_calling = 1;
        pthread_mutex_unlock(&g_lock);
        for (unsigned int i = 0; i < ncalls; i++) calls[i].fn(calls[i].data, level, copy, n);
        free(copy);
        pthread_mutex_lock(&g_lock);
        g_calling = 0;
        pthread_cond_broadcast(&g_called);
    }
    return NULL;
}

/* A forked child has no callbacks' thread: the next registration starts one. */
static void forked_child(void) {
    pthread_mutex_init(&g_lock, NULL);
    pthread_cond_init(&g_wake, NULL);
    pthread_cond_init(&g_called, NULL);
    g_thread_started = 0;
    g_calling = 0;
}

static void start_thread_locked(void) {
    static int atfork;
    if (g_thread_started) return;
    if (!atfork) atfork = !pthread_atfork(NULL, NULL, forked_child);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    g_delivered = g_next;   /* callbacks get the lines written from their registration on */
    g_thread_started = pthread_create(&g_thread, &attr, deliver, NULL) == 0;
    pthread_attr_destroy(&attr);
}

RGPU_EXPORT CUresult CUDAAPI cuLogsRegisterCallback(CUlogsCallback callbackFunc, void *userData,
                                                    CUlogsCallbackHandle *callback_out) {
    if (!callbackFunc || !callback_out) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_lock);
    for (unsigned int i = 0; i < MAX_CALLBACKS; i++) {
        if (g_callbacks[i].id) continue;
        g_callbacks[i] = (log_callback){callbackFunc, userData, g_next_id++};
        *callback_out = (CUlogsCallbackHandle)(uintptr_t)g_callbacks[i].id;
        start_thread_locked();
        r = g_thread_started ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        if (r != CUDA_SUCCESS) g_callbacks[i].id = 0;
        break;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLogsUnregisterCallback(CUlogsCallbackHandle callback) {
    unsigned long id = (unsigned long)(uintptr_t)callback;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (unsigned int i = 0; id && i < MAX_CALLBACKS; i++) {
        if (g_callbacks[i].id != id) continue;
        g_callbacks[i].id = 0;
        r = CUDA_SUCCESS;
        break;
    }
    /* Once this returns the callback is not running and will not run: the application may free
     * what its userData points to (unless the callback itself unregisters). */
    while (r == CUDA_SUCCESS && g_calling && !pthread_equal(pthread_self(), g_thread))
        pthread_cond_wait(&g_called, &g_lock);
    pthread_mutex_unlock(&g_lock);
    return r;
}

RGPU_EXPORT CUresult CUDAAPI cuLogsCurrent(CUlogIterator *iterator_out, unsigned int flags) {
    if (!iterator_out || flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    *iterator_out = g_next;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}

/* The lines from *iterator (all kept lines without one) that fit in `room` bytes, copied with `put`;
 * advances *iterator past them. Returns the bytes written; *none_fit when lines were waiting and
 * not one fitted. */
static size_t dump_locked(CUlogIterator *iterator, size_t room, int *none_fit,
                          void (*put)(void *to, const char *text, size_t len), void *to) {
    unsigned int from = iterator ? *iterator : g_first;
    size_t written = 0;
    *none_fit = 0;
    if ((int)(g_first - from) > 0) {   /* the lines since were overwritten */
        char note[96];
        int k = snprintf(note, sizeof note, "[rgpu] %u earlier log line(s) were overwritten\n", g_first - from);
        if (k > 0 && (size_t)k <= room) {
            put(to, note, (size_t)k);
            written += (size_t)k;
        }
        from = g_first;
    }
    if ((int)(g_next - from) < 0) from = g_next;   /* an iterator from the future: nothing to dump */
    unsigned int n = from;
    for (; n != g_next; n++) {
        const log_line *l = &g_lines[n % MAX_LINES];
        if (written + l->len > room) break;
        put(to, l->text, l->len);
        written += l->len;
    }
    *none_fit = n == from && n != g_next && written == 0;
    if (iterator) *iterator = n;
    return written;
}

typedef struct {
    char *at;
} memory_sink;

static void to_memory(void *to, const char *text, size_t len) {
    memory_sink *m = to;
    memcpy(m->at, text, len);
    m->at += len;
}

static void to_file(void *to, const char *text, size_t len) {
    fwrite(text, 1, len, (FILE *)to);
}

RGPU_EXPORT CUresult CUDAAPI cuLogsDumpToMemory(CUlogIterator *iterator, char *buffer, size_t *size,
                                                unsigned int flags) {
    if (!buffer || !size || !*size || flags) {
        if (size) *size = 0;
        return CUDA_ERROR_INVALID_VALUE;
    }
    memory_sink sink = {buffer};
    int none_fit;
    pthread_mutex_lock(&g_lock);
    size_t written = dump_locked(iterator, *size - 1, &none_fit, to_memory, &sink);
    pthread_mutex_unlock(&g_lock);
    buffer[written] = 0;
    *size = written;
    return none_fit ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

RGPU_EXPORT CUresult CUDAAPI cuLogsDumpToFile(CUlogIterator *iterator, const char *pathToFile, unsigned int flags) {
    if (!pathToFile || flags) return CUDA_ERROR_INVALID_VALUE;
    FILE *f = fopen(pathToFile, "a");
    if (!f) return CUDA_ERROR_INVALID_VALUE;
    int none_fit;
    pthread_mutex_lock(&g_lock);
    dump_locked(iterator, (size_t)-1, &none_fit, to_file, f);
    pthread_mutex_unlock(&g_lock);
    return fclose(f) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
