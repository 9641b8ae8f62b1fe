/*
 * Probe loops of the master's key table (kvtier/keytable.py): open addressing with linear probing over 16-byte
 * keys held as two uint64 columns plus a one-byte slot state.
 *
 * Why native: the table's numpy path costs ~25 vectorized passes per 2,000-key batch (one per probe round,
 * each a few microseconds of interpreter and temporary-array overhead); a plain loop does the same batch in
 * one pass, prefetching home slots a few keys ahead so the cache misses of a large table overlap. Both paths
 * compute the same home slot (the same mix) and give the same answers; tests check one against the other.
 *
 * Called through ctypes, which releases the GIL; the arrays belong to the caller and are not retained.
 */
#include <stdint.h>

#define KVTIER_API __attribute__((visibility("default")))

enum { SLOT_EMPTY = 0, SLOT_LIVE = 1, SLOT_TOMBSTONE = 2 };
#define PREFETCH_AHEAD 8

static inline uint64_t home_slot(uint64_t q0, uint64_t q1, uint64_t mask) {
    uint64_t h = (q0 ^ (q1 * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
    return (h ^ (h >> 31)) & mask;
}

/* out[i] = slot of key i (q[2i], q[2i+1]) or -1. Returns how many were found. */
KVTIER_API int64_t kvtier_keytable_find(const uint64_t *k0, const uint64_t *k1, const uint8_t *state,
                                        uint64_t mask, const uint64_t *q, int64_t n, int64_t *out) {
    int64_t found = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            uint64_t h = home_slot(q[2 * (i + PREFETCH_AHEAD)], q[2 * (i + PREFETCH_AHEAD) + 1], mask);
            __builtin_prefetch(&state[h]);
            __builtin_prefetch(&k0[h]);
            __builtin_prefetch(&k1[h]);
        }
        uint64_t q0 = q[2 * i], q1 = q[2 * i + 1];
        uint64_t s = home_slot(q0, q1, mask);
        out[i] = -1;
        for (uint64_t probes = 0; probes <= mask; probes++, s = (s + 1) & mask) {
            uint8_t st = state[s];
            if (st == SLOT_EMPTY)
                break; /* a key is never stored past an empty slot of its probe path */
            if (st == SLOT_LIVE && k0[s] == q0 && k1[s] == q1) {
                out[i] = (int64_t)s;
                found++;
                break;
            }
        }
    }
    return found;
}

/* Put distinct keys known to be absent into the first non-live slot of their probe path; out[i] = its slot.
 * Returns how many tombstones were reused, or -1 if the table is full (the caller keeps load <= 0.7). */
KVTIER_API int64_t kvtier_keytable_place(uint64_t *k0, uint64_t *k1, uint8_t *state, uint64_t mask,
                                         const uint64_t *q, int64_t n, int64_t *out) {
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t q0 = q[2 * i], q1 = q[2 * i + 1];
        uint64_t s = home_slot(q0, q1, mask);
        uint64_t probes = 0;
        while (state[s] == SLOT_LIVE) {
            if (++probes > mask)
                return -1;
            s = (s + 1) & mask;
        }
        reused += state[s] == SLOT_TOMBSTONE;
        state[s] = SLOT_LIVE;
        k0[s] = q0;
        k1[s] = q1;
        out[i] = (int64_t)s;
    }
    return reused;
}
