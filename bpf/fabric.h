/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Testbed fabric (bpf/fabric.bpf.c): maps shared with userspace.
 * Mirrored once in pydblp/testbed/fabric.py; tests/linux/test_fabric.py
 * checks sizes and offsets against the compiled object's BTF types.
 *
 * Probabilities are fixed point, FABRIC_P_ONE = 1.0: a packet is dropped
 * when bpf_get_prandom_u32() < p (so p = FABRIC_P_ONE always drops).
 */
#ifndef DBLP_FABRIC_H
#define DBLP_FABRIC_H

#include <linux/types.h>

#define FABRIC_P_ONE       (1ULL << 32)
#define FABRIC_MAX_PORTS   256
#define FABRIC_MSG_ENTRIES 65536
#define FABRIC_NPRIO       8

/* fabric_cfg.flags */
#define FABRIC_F_GE    (1 << 0)  /* Gilbert-Elliott loss on */
#define FABRIC_F_QUEUE (1 << 1)  /* virtual queue on (rate, buffer) */
#define FABRIC_F_DSCP  (1 << 2)  /* early drop by the IP header's DSCP (dscp_prio), not the DBLP prio */
#define FABRIC_F_DELAY (1 << 3)  /* admitted unicast goes up the bridge to the port's qdisc, which delays it */
#define FABRIC_F_MARK_DROP (1 << 4)  /* past the mark, IP frames that cannot be marked (Not-ECT) are dropped */
#define FABRIC_NDSCP   64

/* counter causes (fabric_ckey.cause) */
#define FABRIC_C_PASS   0  /* forwarded to its egress port */
#define FABRIC_C_LOSS   1  /* Bernoulli loss */
#define FABRIC_C_GE     2  /* Gilbert-Elliott loss */
#define FABRIC_C_BURST  3  /* inside an armed microburst window */
#define FABRIC_C_TAIL   4  /* virtual queue full */
#define FABRIC_C_BOUND  5  /* early drop refused: the message's bound was spent (forwarded) */
#define FABRIC_C_FLOOD  6  /* not a known unicast destination: forwarded, no faults (ingress port) */
#define FABRIC_C_MARK   7  /* ECN-capable, admitted past the queue's mark: set to CE (also counted PASS) */
#define FABRIC_C_EARLY  8  /* + DBLP prio: priority-aware early drop */
#define FABRIC_C_MARK_DROP 16  /* Not-ECT IP frame past the mark (FABRIC_F_MARK_DROP): dropped */
#define FABRIC_NCAUSES  17

/* Per egress port (switch-side ifindex), written by userspace. */
struct fabric_cfg {
	__u64 loss;            /* Bernoulli drop probability */
	__u64 ge_p;            /* good -> bad, per packet */
	__u64 ge_r;            /* bad -> good, per packet */
	__u64 ge_loss_good;    /* drop probability in the good state (1 - k) */
	__u64 ge_loss_bad;     /* drop probability in the bad state (1 - h) */
	__u64 burst_ratio;     /* drop probability inside a burst window */
	__u64 burst_start_ns;  /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) of window 0 */
	__u64 burst_dur_ns;    /* window length; 0 = no burst armed */
	__u64 burst_period_ns; /* window k starts at start + k * period; 0 = one window */
	__u64 burst_count;     /* number of windows when periodic; 0 = unlimited */
	__u64 rate;            /* virtual queue drain rate, bytes per second */
	__u32 buffer;          /* virtual queue capacity, bytes: tail drop beyond it */
	__u32 flags;           /* FABRIC_F_* */
	__u32 thresh[FABRIC_NPRIO]; /* early drop of DBLP prio p when backlog + len > thresh[p]; 0 = never */
	__u8  dscp_prio[FABRIC_NDSCP]; /* FABRIC_F_DSCP: DSCP -> prio (pydblp.dscp.prio_table; 0 never) */
	__u32 mark;            /* ECN: set CE on ECT frames admitted while backlog + len > mark; 0 = never */
	__u32 pad;             /* 0 */
};

/* Per egress port, kernel-owned. */
struct fabric_state {
	struct bpf_spin_lock lock;
	__u32 ge_bad;          /* Gilbert-Elliott state: 1 = bad */
	__u64 backlog;         /* virtual queue, bytes */
	__u64 last_ns;         /* last drain */
	__u64 peak;            /* largest backlog seen */
};

struct fabric_ckey {
	__u32 ifindex;
	__u32 cause;
};

struct fabric_cval {
	__u64 packets;
	__u64 bytes;
};

/* One DBLP message as the fabric sees it: early drops are counted per key.
 * A reduce-scatter and an all-gather message between the same ranks are two. */
struct fabric_msg {
	__u32 job;
	__u32 round;
	__u16 tensor;
	__u16 src;
	__u16 dst;
	__u16 port;            /* a broadcast message's copy: its egress ifindex (low 16 bits); else 0 */
	__u16 allgather;       /* 1: DATA with DBLP_FLAG_ALLGATHER; else 0 */
	__u16 pad;             /* 0: the key is hashed whole */
};

struct fabric_mac {
	__u8 addr[6];
	__u16 pad;
};

#endif /* DBLP_FABRIC_H */
