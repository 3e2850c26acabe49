/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* DBLP wire format v1 and the structs shared by the BPF programs and
 * userspace.  Mirrored once in pydblp/wire.py (header, reasons) and
 * pydblp/bpf.py (maps); tests/unit/test_header_agreement.py keeps them equal.
 */
#ifndef DBLP_H
#define DBLP_H

#include <linux/types.h>

#define DBLP_MAGIC        0xDB1B
#define DBLP_VERSION      1
#define DBLP_HEADER_LEN   32
#define DBLP_TAG_LEN      16
#define DBLP_DEFAULT_PORT 47800
#define DBLP_MAX_NCHUNKS  (1 << 24)
#define DBLP_MAX_PRIO     7
#define DBLP_TOL_SCALE    255

/* kind */
#define DBLP_KIND_DATA    1
#define DBLP_KIND_PROBE   2
#define DBLP_KIND_BITMAP  3
#define DBLP_KIND_STOP    4
#define DBLP_KIND_HELLO   5

/* dtype */
#define DBLP_DTYPE_F32    0
#define DBLP_DTYPE_F16    1
#define DBLP_DTYPE_BF16   2
#define DBLP_DTYPE_RAW    3

/* flags */
#define DBLP_FLAG_RETX      (1 << 0)
#define DBLP_FLAG_ALLGATHER (1 << 1)
#define DBLP_FLAG_TAG       (1 << 2)

/* Why a packet is malformed: the drop counters' index. */
#define DBLP_REASON_OK      0
#define DBLP_REASON_SHORT   1
#define DBLP_REASON_MAGIC   2
#define DBLP_REASON_VERSION 3
#define DBLP_REASON_KIND    4
#define DBLP_REASON_LENGTH  5
#define DBLP_REASON_CHUNK   6
#define DBLP_REASON_NCHUNKS 7
#define DBLP_REASON_RANK    8
#define DBLP_REASON_JOB     9
#define DBLP_REASON_DST     10
#define DBLP_REASON_TAG     11

/* All multi-byte fields are big-endian on the wire. */
struct dblp_hdr {
	__u16 magic;
	__u8  version;
	__u8  kind;
	__u32 job;
	__u32 round;
	__u16 tensor;
	__u16 src;
	__u16 dst;
	__u8  prio;
	__u8  dtype;
	__u32 chunk;
	__u32 nchunks;
	__u16 len;
	__u8  tol;
	__u8  flags;
} __attribute__((packed));

#endif /* DBLP_H */
