/* UCX underneath the data path: see ucx_link.h. UCP's types come from <ucp/api/ucp.h> when the
 * build has it (libucx-dev); otherwise from the few declarations below, which follow UCP 1.x's ABI
 * (every structure is read by UCP only as far as its field mask says, so a prefix suffices). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ucx_link.h"

#if defined(__has_include) && !defined(RGPU_UCX_NO_HEADER)
#if __has_include(<ucp/api/ucp.h>)
#include <ucp/api/ucp.h>
#define RGPU_UCX_HEADER 1
#endif
#endif

#ifndef RGPU_UCX_HEADER
/* ---- the part of UCP's API this file uses, declared here (no libucx-dev at build time) ---- */
typedef int ucs_status_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_config ucp_config_t;
typedef uint64_t ucp_tag_t;
typedef struct { ucp_tag_t sender_tag; size_t length; } ucp_tag_recv_info_t;
typedef struct { uint64_t field_mask; uint64_t features; char rest[256]; } ucp_params_t;
typedef struct { uint64_t field_mask; int thread_mode; char rest[256]; } ucp_worker_params_t;
typedef struct { uint64_t field_mask; const ucp_address_t *address; char rest[256]; } ucp_ep_params_t;
typedef struct { uint32_t op_attr_mask; uint32_t flags; void *request; char rest[256]; } ucp_request_param_t;
#define UCS_OK 0
#define UCS_INPROGRESS 1
#define UCS_ERR_CANCELED (-16)
#define UCS_ERR_LAST (-100)
#define UCS_PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)UCS_ERR_LAST)
#define UCS_PTR_STATUS(p) ((ucs_status_t)(intptr_t)(p))
#define UCP_PARAM_FIELD_FEATURES (1u << 0)
#define UCP_FEATURE_TAG (1u << 0)
#define UCP_WORKER_PARAM_FIELD_THREAD_MODE (1u << 0)
#define UCS_THREAD_MODE_SINGLE 0
#define UCS_THREAD_MODE_SERIALIZED 1
#define UCP_EP_PARAM_FIELD_REMOTE_ADDRESS (1u << 0)
#define UCP_OP_ATTR_FIELD_FLAGS (1u << 4)
#define UCP_OP_ATTR_FLAG_NO_IMM_CMPL (1u << 16)
#define UCP_EP_CLOSE_FLAG_FORCE (1u << 0)
#define UCP_API_MAJOR 1
#define UCP_API_MINOR 10
#endif

/* UCP's entry points, found with dlsym. */
struct ucp_fns {
    ucs_status_t (*init_version)(unsigned, unsigned, const ucp_params_t *, const ucp_config_t *, ucp_context_h *);
    void (*cleanup)(ucp_context_h);
    ucs_status_t (*worker_create)(ucp_context_h, const ucp_worker_params_t *, ucp_worker_h *);
    void (*worker_destroy)(ucp_worker_h);
    ucs_status_t (*worker_get_address)(ucp_worker_h, ucp_address_t **, size_t *);
    void (*worker_release_address)(ucp_worker_h, ucp_address_t *);
    unsigned (*worker_progress)(ucp_worker_h);
    ucs_status_t (*ep_create)(ucp_worker_h, const ucp_ep_params_t *, ucp_ep_h *);
    void *(*ep_close_nbx)(ucp_ep_h, const ucp_request_param_t *);
    void *(*tag_send_nbx)(ucp_ep_h, const void *, size_t, ucp_tag_t, const ucp_request_param_t *);
    void *(*tag_recv_nbx)(ucp_worker_h, void *, size_t, ucp_tag_t, ucp_tag_t, const ucp_request_param_t *);
    ucs_status_t (*tag_recv_request_test)(void *, ucp_tag_recv_info_t *);
    ucs_status_t (*request_check_status)(void *);
    void (*request_cancel)(ucp_worker_h, void *);
    void (*request_free)(void *);
    const char *(*status_string)(ucs_status_t);
    void (*ep_print_info)(ucp_ep_h, FILE *);
};

struct rgpu_ucx {
    void *lib;
    struct ucp_fns f;
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_ep_h ep;
    ucp_address_t *address;
    size_t address_len;
};

static const char *status_text(rgpu_ucx *u, ucs_status_t st) {
    const char *t = u->f.status_string ? u->f.status_string(st) : NULL;
    return t ? t : "unknown UCX status";
}

static void *open_library(const char *folder, char *why, size_t whylen) {
    if (folder && *folder) {
        static const char *const names[] = {"libucp.so.0", "libucp.so"};
        for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", folder, names[i]);
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (h) return h;
        }
        snprintf(why, whylen, "RGPU_UCX_LIB=%s has no loadable libucp.so.0 or libucp.so: %s", folder, dlerror());
        return NULL;
    }
    void *h = dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        snprintf(why, whylen, "cannot load libucp.so.0 (%s; install libucx0, or point RGPU_UCX_LIB at the lib "
                 "folder of the libucx-cu13 wheel)", dlerror());
    return h;
}

#define FIND(field, name)                                                                 \
    do {                                                                                  \
        *(void **)&u->f.field = dlsym(u->lib, name);                                      \
        if (!u->f.field) {                                                                \
            snprintf(why, whylen, "the loaded libucp has no %s (UCX older than 1.10?)", name); \
            goto fail;                                                                    \
        }                                                                                 \
    } while (0)

rgpu_ucx *rgpu_ucx_open(const char *folder, int threads, char *why, size_t whylen) {
    rgpu_ucx *u = calloc(1, sizeof *u);
    if (!u) {
        snprintf(why, whylen, "out of memory");
        return NULL;
    }
    u->lib = open_library(folder, why, whylen);
    if (!u->lib) {
        free(u);
        return NULL;
    }
    FIND(init_version, "ucp_init_version");
    FIND(cleanup, "ucp_cleanup");
    FIND(worker_create, "ucp_worker_create");
    FIND(worker_destroy, "ucp_worker_destroy");
    FIND(worker_get_address, "ucp_worker_get_address");
    FIND(worker_release_address, "ucp_worker_release_address");
    FIND(worker_progress, "ucp_worker_progress");
    FIND(ep_create, "ucp_ep_create");
    FIND(ep_close_nbx, "ucp_ep_close_nbx");
    FIND(tag_send_nbx, "ucp_tag_send_nbx");
    FIND(tag_recv_nbx, "ucp_tag_recv_nbx");
    FIND(tag_recv_request_test, "ucp_tag_recv_request_test");
    FIND(request_check_status, "ucp_request_check_status");
    FIND(request_cancel, "ucp_request_cancel");
    FIND(request_free, "ucp_request_free");
    *(void **)&u->f.status_string = dlsym(u->lib, "ucs_status_string");   /* optional: messages only */
    *(void **)&u->f.ep_print_info = dlsym(u->lib, "ucp_ep_print_info");   /* optional: rgpu_ucx_describe */

    ucp_params_t params;
    memset(&params, 0, sizeof params);
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucs_status_t st = u->f.init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, NULL, &u->context);
    if (st != UCS_OK) {
        snprintf(why, whylen, "ucp_init failed: %s (check UCX_TLS and `ucx_info -d`)", status_text(u, st));
        u->context = NULL;
        goto fail;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof wp);
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = threads ? UCS_THREAD_MODE_SERIALIZED : UCS_THREAD_MODE_SINGLE;
    st = u->f.worker_create(u->context, &wp, &u->worker);
    if (st != UCS_OK) {
        snprintf(why, whylen, "ucp_worker_create failed: %s", status_text(u, st));
        u->worker = NULL;
        goto fail;
    }
    st = u->f.worker_get_address(u->worker, &u->address, &u->address_len);
    if (st != UCS_OK) {
        snprintf(why, whylen, "ucp_worker_get_address failed: %s", status_text(u, st));
        u->address = NULL;
        goto fail;
    }
    return u;
fail:
    rgpu_ucx_close(u);
    return NULL;
}

size_t rgpu_ucx_address(rgpu_ucx *u, const void **address) {
    *address = u->address;
    return u->address_len;
}

int rgpu_ucx_connect(rgpu_ucx *u, const void *peer, size_t len, char *why, size_t whylen) {
    (void)len;
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof ep);
    /* No UCP_ERR_HANDLING_MODE_PEER: UCX 1.13 then refuses its shared-memory transports ("no peer
     * failure handler"). A dead peer is noticed by rgpu_ucx_wait instead (the session's TCP socket
     * ends, or nothing progresses for the idle limit). */
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = peer;
    ucs_status_t st = u->f.ep_create(u->worker, &ep, &u->ep);
    if (st != UCS_OK) {
        u->ep = NULL;
        snprintf(why, whylen, "ucp_ep_create to the peer's worker failed: %s (no common transport? compare "
                 "UCX_TLS on both ends)", status_text(u, st));
        return -1;
    }
    return 0;
}

/* Whether `name` is one of the ", "-separated names of `list`. */
static int listed(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *at = list; (at = strstr(at, name)) != NULL; at += n)
        if ((at == list || at[-1] == ' ') && (at[n] == ',' || at[n] == 0)) return 1;
    return 0;
}

/* UCX's endpoint report has one line per lane, "#   lane[0]:  3:sysv/memory.0 md[2] -> ...": keep each
 * lane's "transport/device" (without the ".0" path index), once each ("tcp/lo" may carry several
 * lanes), in lane order. `report` is cut into lines in place. */
static void lanes_from_report(char *report, char *out, size_t outlen) {
    size_t used = 0;
    char *save = NULL;
    out[0] = 0;
    for (char *line = strtok_r(report, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        const char *lane = strstr(line, "lane[");
        char name[128];
        if (!lane || sscanf(lane, "lane[%*u]: %*u:%127s", name) != 1) continue;
        char *dot = strrchr(name, '.');
        if (dot && dot[1] && strspn(dot + 1, "0123456789") == strlen(dot + 1)) *dot = 0;
        if (!strchr(name, '/') || listed(out, name)) continue;
        int w = snprintf(out + used, outlen - used, "%s%s", used ? ", " : "", name);
        if (w < 0 || (size_t)w >= outlen - used) {   /* no room: keep the names that fitted whole */
            out[used] = 0;
            return;
        }
        used += (size_t)w;
    }
}

size_t rgpu_ucx_describe(rgpu_ucx *u, char *out, size_t outlen) {
    if (!outlen) return 0;
    out[0] = 0;
    if (!u || !u->ep || !u->f.ep_print_info) return 0;
    char *report = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&report, &size);
    if (!f) return 0;
    u->f.ep_print_info(u->ep, f);
    fclose(f);
    if (report) lanes_from_report(report, out, outlen);
    free(report);
    return strlen(out);
}

int rgpu_ucx_post(rgpu_ucx *u, int recv, uint64_t tag, void *p, size_t n, void **req, char *why, size_t whylen) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof param);
    void *r;
    if (recv) {
        param.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;   /* always a request: its length is checked */
        r = u->f.tag_recv_nbx(u->worker, p, n, tag, ~(uint64_t)0, &param);
    } else {
        if (!u->ep) {
            snprintf(why, whylen, "no UCX endpoint to the peer");
            return -1;
        }
        r = u->f.tag_send_nbx(u->ep, p, n, tag, &param);
    }
    if (UCS_PTR_IS_ERR(r)) {
        snprintf(why, whylen, "UCX %s of %zu bytes failed at once: %s", recv ? "receive" : "send", n,
                 status_text(u, UCS_PTR_STATUS(r)));
        *req = NULL;
        return -1;
    }
    *req = r;
    return 0;
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The session's socket: 2 it ended (the peer is gone), 1 it has bytes to read, 0 neither. */
static int socket_state(int fd) {
    if (fd < 0) return 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&pfd, 1, 0) <= 0) return 0;
    if (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) return 2;
    return (pfd.revents & POLLIN) ? 1 : 0;
}

/* Close the endpoint by force: UCX completes the sends still queued on it with UCS_ERR_CANCELED,
 * and later sends on this link fail at once ("no UCX endpoint to the peer"). */
static void close_endpoint(rgpu_ucx *u) {
    if (!u->ep) return;
    ucp_request_param_t param;
    memset(&param, 0, sizeof param);
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *r = u->f.ep_close_nbx(u->ep, &param);
    u->ep = NULL;
    if (r && !UCS_PTR_IS_ERR(r)) {
        while (u->f.request_check_status(r) == UCS_INPROGRESS) u->f.worker_progress(u->worker);
        u->f.request_free(r);
    }
}

/* A request nobody will wait for: ended and released. A tag receive is cancelled and waited for
 * (it may be taking bytes into its buffer: it must not outlive this). UCX ignores
 * ucp_request_cancel on a send (UCX 1.13), so a send to a peer that never takes its bytes would
 * spin here for ever: one still running after ABANDON_GRACE_S has the endpoint closed by force,
 * which ends the sends still queued on it. A rendezvous send the peer was already told of stays
 * running even then (UCX 1.13, shared memory): it is left unreleased rather than waited for, and
 * UCX notes it at exit ("was not returned to mpool ucp_requests"). */
#define ABANDON_GRACE_S 0.2
static void abandon(rgpu_ucx *u, void *req, int recv) {
    u->f.request_cancel(u->worker, req);
    double grace = seconds() + ABANDON_GRACE_S;
    while (u->f.request_check_status(req) == UCS_INPROGRESS) {
        double now = seconds();
        if (!recv && now > grace) {
            if (!u->ep) return;
            close_endpoint(u);
            grace = now + ABANDON_GRACE_S;
        }
        u->f.worker_progress(u->worker);
    }
    u->f.request_free(req);
}

int rgpu_ucx_wait(rgpu_ucx *u, void *req, int recv, size_t want, double idle_s, int fd, int flags, char *why,
                  size_t whylen) {
    if (!req) {
        if (recv) {   /* receives are posted with NO_IMM_CMPL: they always give a request */
            snprintf(why, whylen, "UCX receive completed without a request (unexpected)");
            return -1;
        }
        return 0;
    }
    if (!recv && !u->ep && u->f.request_check_status(req) == UCS_INPROGRESS) {
        /* An earlier send was abandoned and closed the endpoint: this one cannot complete either
         * (the rest of a chunked copy's would each wait out the idle limit). Left to UCX. */
        snprintf(why, whylen, "UCX send of %zu bytes given up: an earlier send on this link failed and closed "
                 "its endpoint", want);
        return -1;
    }
    double last = seconds();
    unsigned spins = 0;
    ucs_status_t st;
    for (;;) {
        st = u->f.request_check_status(req);
        if (st != UCS_INPROGRESS) break;
        if (u->f.worker_progress(u->worker)) {
            last = seconds();
            spins = 0;
            continue;
        }
        /* Shared-memory transports need both ends to run: on a busy node (a GPU node running jobs) a
         * waiter that only spins keeps its peer off the core it waits for. */
        if (++spins % 64 == 0) sched_yield();
        if (spins % 4096 == 0) {
            double now = seconds();
            int sock = socket_state(fd);
            /* A frame came while this waits (a host function's call, the client's HOST_CALL): the
             * caller serves it, the peer may need that before it takes these bytes. */
            if (sock == 1 && (flags & RGPU_UCX_YIELD_READABLE)) return 1;
            if (now - last > idle_s || sock == 2) {
                abandon(u, req, recv);
                if (now - last > idle_s)
                    snprintf(why, whylen, "UCX %s of %zu bytes made no progress for %.0f s (the peer never %s "
                             "them; cancelled)", recv ? "receive" : "send", want, idle_s,
                             recv ? "sent" : "took");
                else
                    snprintf(why, whylen, "the peer closed the session during a UCX %s", recv ? "receive" : "send");
                return -1;
            }
        }
    }
    size_t got = want;
    if (st == UCS_OK && recv) {
        ucp_tag_recv_info_t info;
        memset(&info, 0, sizeof info);
        if (u->f.tag_recv_request_test(req, &info) == UCS_OK) got = info.length;
    }
    u->f.request_free(req);
    if (st != UCS_OK) {
        snprintf(why, whylen, "UCX %s of %zu bytes failed: %s", recv ? "receive" : "send", want, status_text(u, st));
        return -1;
    }
    if (got != want) {
        snprintf(why, whylen, "UCX receive brought %zu bytes where %zu were announced", got, want);
        return -1;
    }
    return 0;
}

void rgpu_ucx_cancel(rgpu_ucx *u, void *req, int recv) {
    if (req) abandon(u, req, recv);
}

void rgpu_ucx_close(rgpu_ucx *u) {
    if (!u) return;
    close_endpoint(u);
    if (u->address) u->f.worker_release_address(u->worker, u->address);
    if (u->worker) u->f.worker_destroy(u->worker);
    if (u->context) u->f.cleanup(u->context);
    /* libucp stays loaded: UCX's own atexit handlers and threads may still refer to it. */
    free(u);
}
