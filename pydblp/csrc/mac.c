/* Batched DBLP tag MACs: keyed BLAKE2b (RFC 7693, with the BLAKE2 parameter
 * block's salt and personalisation) over many packets in one call.
 *
 * A packet's MAC input is a prefix (its 32-byte header record) followed by its
 * payload bytes; the two live in separate arrays (numpy rows), so no packet is
 * copied into one buffer first.  LANES packets are hashed side by side, one per
 * lane of a vector of 64-bit words (GCC/Clang vector extensions: AVX-512,
 * AVX2, SSE2 or NEON, whatever the compiler was told the CPU has), so one
 * G function's instructions serve LANES packets.  Lanes whose packets have
 * fewer blocks keep their state once done (a per-lane select), so packets of
 * any lengths may share a group.
 *
 * The result must equal Python's hashlib.blake2b(data, key=key,
 * digest_size=outlen, salt=salt, person=person).digest() byte for byte
 * (pydblp.wire.tag is the definition; tests/unit/test_mac.py checks).
 *
 * Built at install (setup.py) or at first use (pydblp/native.py), loaded with ctypes.
 */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef LANES /* packets per vector: one 64-bit word each */
#if defined(__AVX512F__)
#define LANES 8 /* one zmm register */
#else
#define LANES 4 /* two SSE/NEON registers or one AVX2: measured faster than 2 or 8 there */
#endif
#endif
#define BLOCK 128

typedef uint64_t vec __attribute__((vector_size(8 * LANES)));

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline uint64_t ror64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

/* ---- one message (the key block, and the reference for the lanes) ---- */

static void compress1(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) v[i] = h[i], v[i + 8] = IV[i];
    v[12] ^= t; /* messages here are far below 2**64 bytes: the high counter word stays 0 */
    if (last) v[14] = ~v[14];
#define G1(a, b, c, d, x, y)                      \
    do {                                          \
        v[a] = v[a] + v[b] + (x);                 \
        v[d] = ror64(v[d] ^ v[a], 32);            \
        v[c] = v[c] + v[d];                       \
        v[b] = ror64(v[b] ^ v[c], 24);            \
        v[a] = v[a] + v[b] + (y);                 \
        v[d] = ror64(v[d] ^ v[a], 16);            \
        v[c] = v[c] + v[d];                       \
        v[b] = ror64(v[b] ^ v[c], 63);            \
    } while (0)
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G1(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G1(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G1(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G1(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G1(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G1(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G1(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G1(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The state after the key block: what every packet's hash continues from.
 * Returns 0, or -1 for a parameter out of BLAKE2b's range. */
int dblp_mac_key(uint64_t h[8], const uint8_t *key, size_t keylen, const uint8_t salt[16],
                 const uint8_t person[16], size_t outlen) {
    if (keylen == 0 || keylen > 64 || outlen == 0 || outlen > 64) return -1;
    for (int i = 0; i < 8; i++) h[i] = IV[i];
    h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    h[4] ^= load64(salt);
    h[5] ^= load64(salt + 8);
    h[6] ^= load64(person);
    h[7] ^= load64(person + 8);
    uint8_t block[BLOCK] = {0};
    memcpy(block, key, keylen);
    compress1(h, block, BLOCK, 0);
    memset(block, 0, sizeof block);
    return 0;
}

/* ---- LANES messages side by side ---- */

static inline vec rorv(vec x, int n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)                       \
    do {                                          \
        v[a] = v[a] + v[b] + (x);                 \
        v[d] = rorv(v[d] ^ v[a], 32);             \
        v[c] = v[c] + v[d];                       \
        v[b] = rorv(v[b] ^ v[c], 24);             \
        v[a] = v[a] + v[b] + (y);                 \
        v[d] = rorv(v[d] ^ v[a], 16);             \
        v[c] = v[c] + v[d];                       \
        v[b] = rorv(v[b] ^ v[c], 63);             \
    } while (0)

#define ROUND(r)                                                   \
    do {                                                           \
        G(0, 4, 8, 12, m[SIGMA[r][0]], m[SIGMA[r][1]]);            \
        G(1, 5, 9, 13, m[SIGMA[r][2]], m[SIGMA[r][3]]);            \
        G(2, 6, 10, 14, m[SIGMA[r][4]], m[SIGMA[r][5]]);           \
        G(3, 7, 11, 15, m[SIGMA[r][6]], m[SIGMA[r][7]]);           \
        G(0, 5, 10, 15, m[SIGMA[r][8]], m[SIGMA[r][9]]);           \
        G(1, 6, 11, 12, m[SIGMA[r][10]], m[SIGMA[r][11]]);         \
        G(2, 7, 8, 13, m[SIGMA[r][12]], m[SIGMA[r][13]]);          \
        G(3, 4, 9, 14, m[SIGMA[r][14]], m[SIGMA[r][15]]);          \
    } while (0)

/* h[i] of lane l = state word i of packet l; t: bytes hashed including this
 * block; last, live: all-ones words for lanes where this block is the final
 * one / exists at all (a lane whose packet has ended keeps its h). */
static inline void compressv(vec h[8], const vec m[16], vec t, vec last, vec live) {
    vec v[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = (vec){0} + IV[i];
    }
    v[12] ^= t;
    v[14] ^= last;
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
    for (int i = 0; i < 8; i++) h[i] ^= (v[i] ^ v[i + 8]) & live;
}

/* A pointer to message block b of a packet (prefix pre[0..plen) then payload
 * pay[0..blen)): into the payload when the block lies wholly inside it, else
 * assembled, zero-padded, in buf. */
static inline const uint8_t *block_at(size_t b, const uint8_t *pre, size_t plen, const uint8_t *pay,
                                      size_t blen, uint8_t *buf) {
    size_t lo = b * BLOCK, hi = lo + BLOCK, total = plen + blen;
    if (lo >= plen && hi <= total) return pay + (lo - plen);
    memset(buf, 0, BLOCK);
    if (lo < plen) memcpy(buf, pre + lo, (plen < hi ? plen : hi) - lo);
    size_t a = lo > plen ? lo : plen, e = hi < total ? hi : total;
    if (e > a) memcpy(buf + (a - lo), pay + (a - plen), e - a);
    return buf;
}

static inline size_t nblocks(size_t len) { return len ? (len + BLOCK - 1) / BLOCK : 1; }

/* MACs of n packets: packet k is row i = rows ? rows[k] : k, its message the
 * plen bytes at pre + i*pstride then body[i] bytes at pay + i*ystride; its
 * outlen-byte MAC goes to out + k*outlen.  h0: dblp_mac_key's state. */
void dblp_mac_batch(const uint64_t h0[8], size_t outlen, size_t n, const uint8_t *pre, size_t plen,
                    size_t pstride, const uint8_t *pay, size_t ystride, const int64_t *body,
                    const int64_t *rows, uint8_t *out) {
    uint8_t buf[LANES][BLOCK];
    for (size_t k0 = 0; k0 < n; k0 += LANES) {
        size_t cnt = n - k0 < LANES ? n - k0 : LANES;
        const uint8_t *lp[LANES], *ly[LANES];
        size_t len[LANES], nb[LANES], most = 0;
        for (size_t l = 0; l < LANES; l++) {
            size_t i = (size_t)(rows ? rows[k0 + (l < cnt ? l : 0)] : (int64_t)(k0 + (l < cnt ? l : 0)));
            lp[l] = pre + i * pstride;
            ly[l] = pay + i * ystride;
            len[l] = (size_t)body[i];
            nb[l] = nblocks(plen + len[l]);
            if (nb[l] > most) most = nb[l];
        }
        vec h[8];
        for (int i = 0; i < 8; i++) h[i] = (vec){0} + h0[i];
        for (size_t b = 0; b < most; b++) {
            vec m[16], t, last, live;
            const uint8_t *p[LANES];
            for (size_t l = 0; l < LANES; l++) {
                size_t total = plen + len[l], end = (b + 1) * BLOCK;
                p[l] = b < nb[l] ? block_at(b, lp[l], plen, ly[l], len[l], buf[l]) : buf[l];
                t[l] = BLOCK + (end < total ? end : total); /* the key block counts */
                last[l] = b + 1 == nb[l] ? ~0ULL : 0;
                live[l] = b < nb[l] ? ~0ULL : 0;
            }
            for (int w = 0; w < 16; w++)
                for (size_t l = 0; l < LANES; l++) m[w][l] = load64(p[l] + 8 * w);
            compressv(h, m, t, last, live);
        }
        for (size_t l = 0; l < cnt; l++) {
            uint8_t d[64];
            for (int i = 0; i < 8; i++) {
                uint64_t w = h[i][l];
                for (int j = 0; j < 8; j++) d[8 * i + j] = (uint8_t)(w >> (8 * j));
            }
            memcpy(out + (k0 + l) * outlen, d, outlen);
        }
    }
}

/* Which source this library was built from (pydblp/native.py tells a stale copy by it). */
#ifndef DBLP_SOURCE_ID
#define DBLP_SOURCE_ID "unknown"
#endif
const char *dblp_source_id(void) { return DBLP_SOURCE_ID; }
