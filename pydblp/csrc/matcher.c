/* Per-packet loops of the collective (pydblp/collective).
 *
 * dblp_absorb takes a received batch: packets whose headers match the round
 * running (Matcher.match's masked 64-bit words) go into it, their payloads copied
 * straight into the reduce buffer (reduce-scatter) or the result (all-gather),
 * masks set, the highest chunk per sender raised, arrivals counted per sender;
 * the rest are listed for Python to sort.  It does only what Matcher.absorb does
 * for a clean batch, and refuses (-1, nothing written) a batch holding anything
 * Matcher.absorb would count or note (a foreign sender, another chunk count, an
 * all-gather packet in a round without one): Python then takes the whole batch,
 * so both paths give the same round (tests/unit/test_udp_native.py).
 * dblp_count_data counts a received batch's DATA per sender (Protocol._count_rx).
 * dblp_data_headers writes the DATA headers of a send turn's part (Protocol._send_batch).
 */

#include <stdint.h>
#include <string.h>

#include "wire.h"

#define ECN_CE 3

static inline int matches(const uint8_t *h, const uint64_t *mask, const uint64_t *vals, int broadcast,
                          int64_t rank) {
    uint64_t w[4];
    memcpy(w, h, sizeof w);
    for (int k = 0; k < 4; k++)
        if ((w[k] & mask[k]) != vals[k]) return 0;
    if (broadcast) { /* dst left out of the mask: this rank's, or an all-gather to all */
        uint32_t dst = be16(h + 16);
        return dst == (uint32_t)rank || (dst == DST_ALL && (h[31] & FLAG_ALLGATHER));
    }
    return 1;
}

/* Packets [0, n): headers at hdrs + 32 i, payloads at pay + i * pstride (chunk
 * bytes c4 each).  The round: reduce-scatter inbox rflat (world * nrs rows of c4
 * bytes, row src * nrs + chunk) and its mask rmflat, unless reduced; all-gather
 * result y (rows of c4 bytes: the round's row ag_first[src] + chunk of ag_n[src],
 * at y's row rowmap[row] when rowmap is not NULL, the result in the tensor's
 * order; y's row tail_row, the tensor's partial last row, at tail instead: the
 * caller's array ends inside it) and its mask have (by the round's row), if gather.  Raises hi[kind * world + src] (kind 0 reduce-scatter,
 * 1 all-gather) to 1 + the furthest chunk in the sender's send order (with
 * stagger, a reduce-scatter sender starts at chunk src * nrs / world, as
 * messages.stagger_first, and
 * wraps; else chunk order), adds to got[kind * world + src], and
 * sets tol[kind * world + src] (-1 before) to the first such packet's bound.
 * Returns how many packets did not match (their rows in rest, in order; ahead[r] 1
 * where rest[r] is one Matcher._sort stashes: of this job, from a peer rank, to
 * this rank or an all-gather to all, of a round 1..stash_ahead past base), or -1. */
int64_t dblp_absorb(const uint8_t *hdrs, int64_t n, const uint8_t *pay, int64_t pstride, const uint64_t *mask,
                    const uint64_t *vals, int broadcast, int64_t rank, int64_t world, int64_t c4, int reduced,
                    uint8_t *rflat, uint8_t *rmflat, int64_t nrs, int stagger, int gather, uint8_t *y,
                    const int64_t *rowmap, int64_t tail_row, uint8_t *tail, uint8_t *have,
                    const int64_t *ag_first, const int64_t *ag_n, int64_t *hi, int64_t *got, int64_t *tol,
                    int64_t *rest, uint8_t *ahead, uint32_t job, uint32_t base, uint32_t stash_ahead) {
    int64_t nrest = 0;
    for (int64_t i = 0; i < n; i++) { /* check everything before writing anything */
        const uint8_t *h = hdrs + i * HEADER_LEN;
        if (!matches(h, mask, vals, broadcast, rank)) {
            uint32_t src = be16(h + 14), dst = be16(h + 16), d = be32(h + 8) - base;
            ahead[nrest] = be32(h + 4) == job && src < (uint32_t)world && src != (uint32_t)rank &&
                           (dst == (uint32_t)rank || (dst == DST_ALL && h[3] == KIND_DATA && (h[31] & FLAG_ALLGATHER))) &&
                           d > 0 && d <= stash_ahead;
            rest[nrest++] = i;
            continue;
        }
        uint32_t src = be16(h + 14), chunk = be32(h + 20), nch = be32(h + 24);
        if (src >= (uint32_t)world || src == (uint32_t)rank || chunk >= nch) return -1;
        if (h[31] & FLAG_ALLGATHER) {
            if (!gather || (int64_t)nch != ag_n[src]) return -1;
        } else if (!reduced && (int64_t)nch != nrs) {
            return -1;
        }
    }
    for (int64_t i = 0, r = 0; i < n; i++) {
        if (r < nrest && rest[r] == i) {
            r++;
            continue;
        }
        const uint8_t *h = hdrs + i * HEADER_LEN;
        uint32_t src = be16(h + 14), chunk = be32(h + 20);
        int kind = (h[31] & FLAG_ALLGATHER) ? 1 : 0;
        int64_t row, sent = chunk; /* its place in the sender's send order */
        if (kind) {
            row = ag_first[src] + chunk;
            int64_t at = rowmap ? rowmap[row] : row;
            memcpy(at == tail_row ? tail : y + at * c4, pay + i * pstride, c4);
            have[row] = 1;
        } else if (!reduced) {
            row = (int64_t)src * nrs + chunk;
            memcpy(rflat + row * c4, pay + i * pstride, c4);
            rmflat[row] = 1;
            if (stagger) {
                sent -= (int64_t)src * nrs / world;
                if (sent < 0) sent += nrs;
            }
        } else {
            continue; /* contributions to a shard already reduced: nothing to do (as matcher.py) */
        }
        int64_t k = kind * world + src;
        if (sent + 1 > hi[k]) hi[k] = sent + 1;
        got[k]++;
        if (tol[k] < 0) tol[k] = h[30];
    }
    return nrest;
}

/* Count a batch of n headers per sender: rx_from[src] += 1 for DATA (senders past
 * the world, and every other kind, at rx_from[world]) and, where ecn is not NULL,
 * the DATA that came CE-marked in ce_from likewise.  Returns how many came CE-marked. */
int64_t dblp_count_data(const uint8_t *hdrs, int64_t n, const uint8_t *ecn, int64_t world, int64_t *rx_from,
                        int64_t *ce_from) {
    int64_t ce = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *h = hdrs + i * HEADER_LEN;
        if (h[3] != KIND_DATA) {
            rx_from[world]++;
            continue;
        }
        int64_t src = be16(h + 14);
        if (src > world) src = world;
        rx_from[src]++;
        if (ecn && ecn[i] == ECN_CE) {
            ce_from[src]++;
            ce++;
        }
    }
    return ce;
}

/* The DATA headers of one message's chunks idx[0..n) at h (32 bytes each), as a send
 * turn writes them: the message's round, tensor, dst, nchunks, tol and flags, this
 * rank's job and src, float32 payloads of len bytes, and per packet its chunk number
 * and priority prio[idx[i]] (wire.FIELDS: offsets).  Where addr is not NULL, also each
 * payload's address: addrs[idx[i]] where addrs is not NULL (a message read where it
 * lies), else base + idx[i] * stride (its rows). */
void dblp_data_headers(uint8_t *h, int64_t n, const int64_t *idx, const uint8_t *prio, uint32_t job,
                       uint32_t round, uint32_t tensor, uint32_t src, uint32_t dst, uint32_t nchunks, uint32_t len,
                       uint32_t tol, uint32_t flags, uint64_t *addr, const uint64_t *addrs, uint64_t base,
                       int64_t stride) {
    uint8_t t[HEADER_LEN];
    put16(t, MAGIC);
    t[2] = VERSION;
    t[3] = KIND_DATA;
    put32(t + 4, job);
    put32(t + 8, round);
    put16(t + 12, tensor);
    put16(t + 14, src);
    put16(t + 16, dst);
    t[18] = 0;
    t[19] = DTYPE_F32;
    put32(t + 20, 0);
    put32(t + 24, nchunks);
    put16(t + 28, len);
    t[30] = (uint8_t)tol;
    t[31] = (uint8_t)flags;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *o = h + i * HEADER_LEN;
        memcpy(o, t, HEADER_LEN);
        o[18] = prio[idx[i]];
        put32(o + 20, (uint32_t)idx[i]);
    }
    if (!addr) return;
    for (int64_t i = 0; i < n; i++)
        addr[i] = addrs ? addrs[idx[i]] : base + (uint64_t)(idx[i] * stride);
}

/* Which source this library was built from (pydblp/native.py tells a stale copy by it). */
#ifndef DBLP_SOURCE_ID
#define DBLP_SOURCE_ID "unknown"
#endif
const char *dblp_source_id(void) { return DBLP_SOURCE_ID; }
