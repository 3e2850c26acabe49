/* The DBLP header as the compiled loops read and write it: pydblp/wire.py's FIELDS
 * (big-endian; the byte offsets the loops use are theirs), constants and checks.
 * tests/unit/test_header_agreement.py holds the constants to wire.py's. */

#ifndef DBLP_CSRC_WIRE_H
#define DBLP_CSRC_WIRE_H

#include <stdint.h>

#define HEADER_LEN 32
#define TAG_LEN 16
#define MAGIC 0xDB1B
#define VERSION 1
#define KIND_MIN 1
#define KIND_MAX 5
#define KIND_DATA 1
#define DTYPE_F32 0
#define MAX_NCHUNKS (1u << 24)
#define FLAG_ALLGATHER 2
#define FLAG_TAG 4
#define DST_ALL 0xFFFF

static inline uint32_t be16(const uint8_t *p) { return (uint32_t)p[0] << 8 | p[1]; }
static inline uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline void put16(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* wire.all_valid's checks (validate_batch's without the rank checks) on the header at h
 * of a datagram whose UDP payload is plen bytes: 1 if it passes. */
static inline int dblp_valid(const uint8_t *h, int64_t plen) {
    uint32_t nch = be32(h + 24);
    return be16(h) == MAGIC && h[2] == VERSION && h[3] >= KIND_MIN && h[3] <= KIND_MAX &&
           (int64_t)be16(h + 28) + ((h[31] & FLAG_TAG) ? TAG_LEN : 0) + HEADER_LEN == plen &&
           nch >= 1 && nch <= MAX_NCHUNKS && be32(h + 20) < nch && be32(h + 4) != 0;
}

#endif
