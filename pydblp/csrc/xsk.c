/* The AF_XDP transport's per-packet loops: one call per batch.
 *
 * Receive (dblp_xsk_rx): take rx descriptors, parse Ethernet/IPv4|IPv6/UDP
 * as pydblp.transport.frames.parse does, check DBLP headers as
 * wire.validate_batch does (when the host program did not), match the
 * source address to a peer id as frames.Sources.match does, read the ECN
 * field as frames.ecn_of does, copy header and payload into a Batch's rows
 * (or leave the payload in UMEM to be lent), count, and give the frames back
 * to the fill ring.
 * Transmit (dblp_xsk_tx): build frames as frames.build_one + set_tos do,
 * straight into free UMEM frames, and write tx descriptors.
 * Ring helpers: produce, reclaim (completion ring), publish.
 *
 * Protocol decisions, waiting, pacing and syscalls stay in Python
 * (pydblp/transport/xsk.py); the pure-Python paths are the reference and
 * tests/unit/test_xsk_native.py holds the two equal.
 *
 * Memory ordering, as the kernel's xsk_queue.h and libxdp: a consumer
 * acquire-loads the producer index before reading entries and
 * release-stores its consumer index after reading them; a producer
 * acquire-loads the consumer index before overwriting entries and
 * release-stores its producer index after writing them.
 *
 * Built at install (setup.py) or at first use (pydblp/native.py), loaded with ctypes.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "wire.h"

struct xdp_desc { /* linux/if_xdp.h */
    uint64_t addr;
    uint32_t len;
    uint32_t options;
};
_Static_assert(sizeof(struct xdp_desc) == 16, "struct xdp_desc is 16 bytes");

/* One mapped ring, as pydblp.transport.xsk_ring.Ring holds it. */
struct ring {
    uint32_t *prod, *cons;
    void *desc; /* struct xdp_desc[n] (rx, tx) or uint64_t[n] (fill, completion) */
    uint32_t mask;
};

/* The receive side's fixed state (xsk.py's _RxCtx). */
struct rx_ctx {
    struct ring rx, fill;
    uint8_t *umem;
    uint64_t umem_len;
    uint32_t fs, port;        /* frame size; UDP destination port accepted */
    int32_t validated, sg;    /* host program checked headers; multi-buffer on */
    const uint32_t *v4;       /* registered IPv4 sources, host order */
    const int32_t *v4_pid;
    const uint8_t *v6;        /* IPv6 sources, 16 bytes each */
    const int32_t *v6_pid;
    uint32_t n4, n6;
    uint64_t *taken;          /* out: frame base of each descriptor taken */
    int64_t *src;             /* scratch: payload offset in UMEM per kept packet */
};

#define ETH_LEN 14
#define IPV4_LEN 20
#define IPV6_LEN 40
#define UDP_LEN 8
#define HDR4 (ETH_LEN + IPV4_LEN + UDP_LEN)
#define HDR6 (ETH_LEN + IPV6_LEN + UDP_LEN)

static inline uint32_t load_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Release-store v at p: a producer index Python computed (paced transmit). */
void dblp_xsk_publish(uint32_t *p, uint32_t v) { store_release(p, v); }

/* Write up to n of addrs at the producer index of a fill/completion-style
 * ring (uint64 entries) and publish them; how many fitted. */
size_t dblp_xsk_produce(const struct ring *r, const uint64_t *addrs, size_t n) {
    uint32_t prod = *r->prod; /* ours: no other writer */
    uint32_t free = r->mask + 1 - (prod - load_acquire(r->cons));
    if (n > free) n = free;
    uint64_t *d = r->desc;
    for (size_t i = 0; i < n; i++) d[(prod + i) & r->mask] = addrs[i];
    if (n) store_release(r->prod, prod + (uint32_t)n);
    return n;
}

/* Take every completed frame off completion ring c into the free list
 * (T entries, a power of two) from index tail; how many. */
size_t dblp_xsk_reclaim(const struct ring *c, uint64_t *freelist, uint32_t T, uint32_t tail) {
    uint32_t cons = *c->cons;
    uint32_t n = load_acquire(c->prod) - cons;
    const uint64_t *d = c->desc;
    for (uint32_t i = 0; i < n; i++) freelist[(tail + i) & (T - 1)] = d[(cons + i) & c->mask];
    if (n) store_release(c->cons, cons + n);
    return n;
}

/* frames.parse for one frame f of flen bytes: the UDP payload's offset and
 * length and the family (4, 6), or 0 when it is no DBLP candidate. */
static inline int parse(const uint8_t *f, int64_t flen, uint32_t port, int64_t *off, int64_t *plen) {
    int64_t u;
    int fam;
    if (flen < ETH_LEN + IPV4_LEN) return 0; /* (too short for any frame plen >= 32 accepts) */
    uint32_t et = be16(f + 12);
    if (et == 0x0800 && f[14] >> 4 == 4 && f[23] == 17) {
        u = ETH_LEN + (f[14] & 0x0F) * 4;
        if (u < ETH_LEN + IPV4_LEN) return 0;
        if ((f[20] & 0x3F) | f[21]) return 0; /* a fragment */
        fam = 4;
    } else if (et == 0x86DD && f[14] >> 4 == 6 && f[20] == 17) {
        u = ETH_LEN + IPV6_LEN;
        fam = 6;
    } else {
        return 0;
    }
    if (flen < u + UDP_LEN + HEADER_LEN) return 0; /* plen < 32 either way */
    int64_t ulen = be16(f + u + 4);
    int64_t p = ulen - UDP_LEN, room = flen - (u + UDP_LEN);
    if (p > room) p = room;
    if (p < HEADER_LEN || be16(f + u + 2) != port) return 0;
    *off = u + UDP_LEN;
    *plen = p;
    return fam;
}

/* frames.Sources.match for one frame: the first registered peer with its source address, or -1. */
static inline int32_t match(const struct rx_ctx *x, const uint8_t *f, int fam) {
    if (fam == 4) {
        uint32_t a = be32(f + 26);
        for (uint32_t i = 0; i < x->n4; i++)
            if (x->v4[i] == a) return x->v4_pid[i];
    } else {
        for (uint32_t i = 0; i < x->n6; i++)
            if (!memcmp(x->v6 + 16 * i, f + 22, 16)) return x->v6_pid[i];
    }
    return -1;
}

/* frames.ecn_of for one frame: the IPv4 TOS byte's or the IPv6 traffic class's low two bits. */
static inline uint8_t ecn_of(const uint8_t *f, int fam) {
    return fam == 4 ? (uint8_t)(f[15] & 3) : (uint8_t)((f[15] >> 4) & 3);
}

/* Receive up to n descriptors (n <= what the caller saw available) from the
 * rx ring into a batch: headers (32-byte records), payload rows (stride
 * pstride, maxlen wide), lengths, peer, and each packet's ECN field (ecn:
 * one byte a row, or NULL: not reported).  With lend, a batch of consecutive
 * frames, all valid, one payload offset, none truncated, keeps its payloads
 * in UMEM (res[1] = 1, res[2] = the first payload's UMEM offset, frames not
 * refilled: x->taken holds them); otherwise payloads are copied and the
 * frames refilled (refill 0 leaves that to the caller, whose pending
 * frames go first).
 * Returns descriptors consumed, or -1 (nothing consumed) when a frame spans
 * descriptors (sg: the Python path takes the batch).
 * res: [0] packets kept, [1] lent, [2] lent payload offset, [3] widest
 * payload, [4] rx_invalid, [5] rx_truncated, [6] rx_bytes, [7] frames refilled,
 * [8] frames to refill (x->taken[0..res[8]), unless lent: the caller refills the rest). */
int64_t dblp_xsk_rx(const struct rx_ctx *x, size_t n, uint8_t *hdrs, uint8_t *pay, size_t pstride, size_t maxlen,
                    int32_t *lengths, int32_t *peer, uint8_t *ecn, int lend, int refill, int64_t *res) {
    uint32_t cons = *x->rx.cons;
    uint32_t avail = load_acquire(x->rx.prod) - cons;
    if (n > avail) n = avail;
    const struct xdp_desc *d = x->rx.desc;
    uint32_t mask = x->rx.mask;
    if (x->sg)
        for (size_t i = 0; i < n; i++)
            if (d[(cons + i) & mask].options) return -1; /* as xsk_rx: any option */
    uint64_t fs = x->fs;
    size_t k = 0;
    int64_t invalid = 0, trunc = 0, bytes = 0, widest = 0, first = -1;
    int contiguous = lend;
    for (size_t i = 0; i < n; i++) {
        struct xdp_desc e = d[(cons + i) & mask];
        uint64_t base = e.addr - e.addr % fs;
        x->taken[i] = base;
        if (contiguous && i && base != x->taken[i - 1] + fs) contiguous = 0;
        int64_t flen = e.len, room = (int64_t)(base + fs - e.addr), off = 0, plen = 0;
        if (base >= x->umem_len || base + fs > x->umem_len) { /* not a frame of ours: never from the kernel */
            x->taken[i] = UINT64_MAX;
            invalid++;
            contiguous = 0;
            continue;
        }
        if (flen > room) flen = room; /* (the kernel never writes past a frame) */
        const uint8_t *f = x->umem + e.addr;
        if (i + 2 < n) __builtin_prefetch(x->umem + d[(cons + i + 2) & mask].addr + 64);
        int fam = parse(f, flen, x->port, &off, &plen);
        const uint8_t *h = f + off;
        if (!fam || (!x->validated && !dblp_valid(h, plen))) {
            invalid++;
            contiguous = 0;
            continue;
        }
        int64_t len = plen - HEADER_LEN;
        if (len > (int64_t)maxlen) {
            trunc++;
            contiguous = 0;
            len = (int64_t)maxlen;
        }
        memcpy(hdrs + HEADER_LEN * k, h, HEADER_LEN);
        lengths[k] = (int32_t)len;
        peer[k] = match(x, f, fam);
        if (ecn) ecn[k] = ecn_of(f, fam);
        int64_t src = (int64_t)(e.addr + off + HEADER_LEN);
        if (lend) {
            x->src[k] = src;
            if (first < 0) first = src - (int64_t)base;
            else if (src - (int64_t)base != first) contiguous = 0;
        } else if (len) {
            memcpy(pay + pstride * k, x->umem + src, (size_t)len);
        }
        if (len > widest) widest = len;
        bytes += len + HEADER_LEN;
        k++;
    }
    int lent = lend && contiguous && k == n && k > 0;
    if (lend && !lent)
        for (size_t j = 0; j < k; j++)
            if (lengths[j]) memcpy(pay + pstride * j, x->umem + x->src[j], (size_t)lengths[j]);
    if (n) store_release(x->rx.cons, cons + (uint32_t)n); /* descriptors read; the frames stay ours */
    size_t filled = 0, j = 0;
    if (!lent) { /* after the payload reads: the kernel may write the frames again */
        for (size_t i = 0; i < n; i++)
            if (x->taken[i] != UINT64_MAX) x->taken[j++] = x->taken[i];
        if (refill) filled = dblp_xsk_produce(&x->fill, x->taken, j);
    }
    res[0] = (int64_t)k;
    res[1] = lent;
    res[2] = lent ? x->src[0] : 0;
    res[3] = widest;
    res[4] = invalid;
    res[5] = trunc;
    res[6] = bytes;
    res[7] = (int64_t)filled;
    res[8] = (int64_t)j;
    return (int64_t)n;
}

/* Sum of a buffer's 16-bit big-endian words (zero-padded), only its value
 * modulo 0xFFFF and whether it is zero matter (callers fold it). */
static inline uint64_t sum_be16(const uint8_t *p, size_t len) {
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 4 <= len; i += 4) {
        uint32_t w;
        memcpy(&w, p + i, 4);
        s += w;
    }
    if (i + 2 <= len) {
        uint16_t w;
        memcpy(&w, p + i, 2);
        s += w;
        i += 2;
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (i < len) s += p[i]; /* the byte is a word's high half: low in host order */
    while (s >> 16) s = (s & 0xFFFF) + (s >> 16);
    return ((s & 0xFF) << 8) | (s >> 8); /* a byte swap: multiplies by 256 modulo 0xFFFF */
#else
    if (i < len) s += (uint64_t)p[i] << 8;
    return s;
#endif
}

static inline uint64_t fold(uint64_t s) {
    for (int r = 0; r < 4; r++) s = (s & 0xFFFF) + (s >> 16);
    return s;
}

/* send's checks on n packets: every peer id below npeers (else -1); out: [0] the
 * longest and [1] the shortest length, [2] the longest header (hlen by peer),
 * [3] the lengths' sum. */
int dblp_xsk_tx_check(size_t n, const int32_t *peer, const int32_t *lengths, size_t npeers, const int64_t *hlen,
                      int64_t *out) {
    int64_t hi = INT32_MIN, lo = INT32_MAX, hl = 0, sum = 0;
    for (size_t i = 0; i < n; i++) {
        if (peer[i] < 0 || (size_t)peer[i] >= npeers) return -1;
        int64_t len = lengths[i];
        if (len > hi) hi = len;
        if (len < lo) lo = len;
        if (hlen[peer[i]] > hl) hl = hlen[peer[i]];
        sum += len;
    }
    out[0] = hi;
    out[1] = lo;
    out[2] = hl;
    out[3] = sum;
    return 0;
}

/* Build m frames (batch rows first..first+m) into UMEM frames taken in
 * order from the free list (T entries, a power of two, from head) and write
 * their descriptors at tx ring index prod; publish: also release the
 * producer index to prod + m (unpaced transmit).  Peer p's header is
 * hlen[p] bytes of tmpl row p (tw wide), partial[p] its constant checksum
 * words; tos: 256 TOS bytes by header prio, or NULL.  Packet i's payload is
 * at paddr[i] when paddr is given (Batch.addr: the tensor's row), else at
 * pay + i * pstride.  flens[i]: frame i's bytes.  Every frame fits a UMEM frame and every peer id is valid (the
 * caller checked).  Returns m, or fewer where the ring has less room. */
size_t dblp_xsk_tx(const struct ring *tx, uint8_t *umem, uint32_t fs, const uint64_t *freelist, uint32_t T,
                   uint32_t head, uint32_t prod, const uint8_t *tmpl, size_t tw, const int64_t *hlen,
                   const uint64_t *partial, const uint8_t *tos, const uint8_t *hdrs, const uint8_t *pay,
                   size_t pstride, const uint64_t *paddr, const int32_t *lengths, const int32_t *peer, size_t m, int64_t *flens,
                   int publish) {
    uint32_t room = tx->mask + 1 - (prod - load_acquire(tx->cons));
    if (m > room) m = room;
    struct xdp_desc *d = tx->desc;
    for (size_t i = 0; i < m; i++) {
        uint64_t addr = freelist[(head + i) & (T - 1)];
        uint8_t *f = umem + addr;
        int32_t p = peer[i];
        size_t hl = (size_t)hlen[p];
        uint32_t len = (uint32_t)lengths[i];
        if (hl + HEADER_LEN + len > fs) { /* (never: the caller checked) */
            m = i;
            break;
        }
        const uint8_t *h = hdrs + HEADER_LEN * i;
        memcpy(f, tmpl + tw * (size_t)p, hl);
        memcpy(f + hl, h, HEADER_LEN);
        memcpy(f + hl + HEADER_LEN, paddr ? (const uint8_t *)(uintptr_t)paddr[i] : pay + pstride * i, len);
        uint32_t ulen = UDP_LEN + HEADER_LEN + len;
        size_t u = hl - UDP_LEN;
        f[u + 4] = (uint8_t)(ulen >> 8);
        f[u + 5] = (uint8_t)ulen;
        uint32_t t = tos ? tos[h[18]] : 0; /* h[18]: prio */
        if (hl == HDR4) {
            uint32_t tot = IPV4_LEN + ulen;
            f[16] = (uint8_t)(tot >> 8);
            f[17] = (uint8_t)tot;
            uint32_t c = (uint32_t)(~fold(partial[p] + tot) & 0xFFFF);
            if (tos) { /* set_tos: RFC 1624 on the word 0x45|TOS */
                c = (~c & 0xFFFF) + t;
                c = (c & 0xFFFF) + (c >> 16);
                c = ~c & 0xFFFF;
                f[15] = (uint8_t)t;
            }
            f[24] = (uint8_t)(c >> 8);
            f[25] = (uint8_t)c;
        } else {
            f[18] = (uint8_t)(ulen >> 8);
            f[19] = (uint8_t)ulen;
            uint64_t s = partial[p] + sum_be16(f + hl, HEADER_LEN + len) + 2 * (uint64_t)ulen;
            uint32_t c = (uint32_t)(~fold(s) & 0xFFFF);
            if (c == 0) c = 0xFFFF;
            f[u + 6] = (uint8_t)(c >> 8);
            f[u + 7] = (uint8_t)c;
            if (tos) {
                f[14] = (uint8_t)(0x60 | (t >> 4));
                f[15] = (uint8_t)((t & 0x0F) << 4);
            }
        }
        uint32_t flen = (uint32_t)(hl + HEADER_LEN + len);
        flens[i] = flen;
        struct xdp_desc *e = &d[(prod + i) & tx->mask];
        e->addr = addr;
        e->len = flen;
        e->options = 0;
    }
    if (publish && m) store_release(tx->prod, prod + (uint32_t)m);
    return m;
}

/* Which source this library was built from (pydblp/native.py tells a stale copy by it). */
#ifndef DBLP_SOURCE_ID
#define DBLP_SOURCE_ID "unknown"
#endif
const char *dblp_source_id(void) { return DBLP_SOURCE_ID; }
