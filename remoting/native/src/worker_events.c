/* The worker's table of the client's events (protocol 8: events are the client's handles), in
 * librgpu-worker.so. The C loop (worker_launch.c) creates, translates and destroys events without
 * the Python worker, so the table lives here; the Python worker's ClientEvents
 * (remoting/datapath/worker/client_handles.py) reads and writes the same table through the
 * exported functions below. Only the worker's serving thread touches it. */
#include <stdlib.h>
#include <string.h>

#include "worker_loop.h"

#define FIRST_SLOTS 1024u

static uint32_t home(uint64_t handle, uint32_t mask) {
    return (uint32_t)((handle * 0x9E3779B97F4A7C15ull) >> 32) & mask;
}

/* The slot holding `handle`, or the empty slot where it would go. */
static uint32_t find(const rgpu_events *t, uint64_t handle) {
    uint32_t i = home(handle, t->mask);
    while (t->slots[2 * i] != handle && t->slots[2 * i] != 0) i = (i + 1) & t->mask;
    return i;
}

RGPU_EXPORT rgpu_events *rgpu_events_new(void) {
    rgpu_events *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->slots = calloc(2 * (size_t)FIRST_SLOTS, sizeof(uint64_t));
    if (!t->slots) {
        free(t);
        return NULL;
    }
    t->mask = FIRST_SLOTS - 1;
    return t;
}

RGPU_EXPORT void rgpu_events_free(rgpu_events *t) {
    if (!t) return;
    free(t->slots);
    free(t);
}

RGPU_EXPORT uint32_t rgpu_events_count(const rgpu_events *t) { return t->count; }

/* Room for `more` new handles at most 3/4 full, doubling the table as needed. */
RGPU_EXPORT int rgpu_events_reserve(rgpu_events *t, uint32_t more) {
    uint64_t slots = (uint64_t)t->mask + 1;
    uint64_t want = (uint64_t)t->count + more;
    if (want * 4 <= slots * 3) return 1;
    while (want * 4 > slots * 3) slots *= 2;
    if (slots > (1ull << 30)) return 0;
    rgpu_events bigger = {calloc(2 * slots, sizeof(uint64_t)), (uint32_t)(slots - 1), 0};
    if (!bigger.slots) return 0;
    for (uint64_t i = 0; i <= t->mask; i++) {
        uint64_t key = t->slots[2 * i];
        if (!key) continue;
        uint32_t j = find(&bigger, key);
        bigger.slots[2 * j] = key;
        bigger.slots[2 * j + 1] = t->slots[2 * i + 1];
        bigger.count++;
    }
    free(t->slots);
    *t = bigger;
    return 1;
}

RGPU_EXPORT int rgpu_events_get(const rgpu_events *t, uint64_t handle, uint64_t *value) {
    if (!handle) return 0;
    uint32_t i = find(t, handle);
    if (!t->slots[2 * i]) return 0;
    *value = t->slots[2 * i + 1];
    return 1;
}

/* Adds or replaces a handle's value; 0 when the table cannot grow (or the handle is 0). */
RGPU_EXPORT int rgpu_events_put(rgpu_events *t, uint64_t handle, uint64_t value) {
    if (!handle || !rgpu_events_reserve(t, 1)) return 0;
    uint32_t i = find(t, handle);
    if (!t->slots[2 * i]) {
        t->slots[2 * i] = handle;
        t->count++;
    }
    t->slots[2 * i + 1] = value;
    return 1;
}

/* Removes a handle, giving its value; 0 when it is not there. The entries after it in its probe
 * run move back, so every lookup still stops at the first empty slot. */
RGPU_EXPORT int rgpu_events_take(rgpu_events *t, uint64_t handle, uint64_t *value) {
    if (!handle) return 0;
    uint32_t i = find(t, handle);
    if (!t->slots[2 * i]) return 0;
    *value = t->slots[2 * i + 1];
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & t->mask; t->slots[2 * j]; j = (j + 1) & t->mask) {
        uint32_t h = home(t->slots[2 * j], t->mask);
        /* j's entry may fill the hole unless its home lies cyclically in (hole, j] */
        int stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (stays) continue;
        t->slots[2 * hole] = t->slots[2 * j];
        t->slots[2 * hole + 1] = t->slots[2 * j + 1];
        hole = j;
    }
    t->slots[2 * hole] = 0;
    t->slots[2 * hole + 1] = 0;
    t->count--;
    return 1;
}
