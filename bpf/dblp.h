/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* DBLP wire format v1 and the structs shared by the BPF programs and
 * userspace.  Mirrored once in pydblp/wire.py (header, reasons) and
 * pydblp/host.py (maps); tests/unit/test_header_agreement.py keeps them equal.
 * For the BPF side only (__KERNEL__), the frame-length and header-parsing
 * helpers both programs use.
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
#define DBLP_DST_ALL      0xFFFF  /* dst of DATA sent to every rank at once (broadcast all-gather) */

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
#define DBLP_FLAG_NEIGHBOUR (1 << 3)  /* a neighbour (gossip) round's message */
#define DBLP_FLAG_FINAL     (1 << 4)  /* BITMAP: what an owner's estimate used */
#define DBLP_FLAG_ASK       (1 << 5)  /* HELLO: asks a quiet peer to say HELLO if busy; bits 6-7 reserved */

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
#define DBLP_REASON_SPOOF_IP  12  /* src rank bound to another source IP (peers map) */
#define DBLP_REASON_SPOOF_MAC 13  /* src rank bound to another source MAC (peers map) */
#define DBLP_REASON_VLAN      14  /* an xsk job's packet behind a VLAN tag: AF_XDP takes untagged frames */

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

/* ---- host program (bpf/dblp_host.bpf.c) maps, mirrored in pydblp/host.py ---- */

#define DBLP_MAX_QUEUES   64
#define DBLP_MAX_JOBS     256
#define DBLP_SHED_ENTRIES 65536
#define DBLP_PRESSURE_MAX 1000

/* transport of a registered job (Python: pydblp.host.JobTransport) */
#define DBLP_JOB_TRANSPORT_XSK 0  /* redirect to the AF_XDP socket of the rx queue */
#define DBLP_JOB_TRANSPORT_UDP 1  /* XDP_PASS to the kernel's UDP stack */

/* counters: one per-CPU u64 per slot */
#define DBLP_CNT_PASS       0   /* not DBLP: passed untouched */
#define DBLP_CNT_DBLP_PASS  1   /* valid DBLP of a udp job: passed */
#define DBLP_CNT_REDIRECT   2   /* valid DBLP: redirected to an AF_XDP socket */
#define DBLP_CNT_NOSOCK     3   /* valid DBLP of an xsk job, no socket on the queue: passed */
#define DBLP_CNT_DROP_BASE  16  /* + reason: malformed, dropped */
#define DBLP_CNT_SHED_BASE  32  /* + prio: shed under pressure */
#define DBLP_CNT_MAX        40

struct dblp_job {
	__u16 world_size;
	__u16 rank;
	__u8  transport;
	__u8  pad[3];
};

/* One message: the shedding budget is counted per key.  A peer's reduce-scatter
 * and all-gather messages of one tensor and round are two messages with a budget
 * each, as the collective accounts them: allgather is 1 for DATA carrying
 * DBLP_FLAG_ALLGATHER, else 0.  Every byte is set (pad = 0): the key is hashed whole. */
struct dblp_msg_key {
	__u32 job;
	__u32 round;
	__u16 tensor;
	__u16 src;
	__u16 allgather;
	__u16 pad;
};

/* where a shedding decision takes a packet's priority from (dblp_host_cfg.classify) */
#define DBLP_CLASSIFY_HEADER 0  /* the DBLP header's prio */
#define DBLP_CLASSIFY_DSCP   1  /* the IP header's DSCP, through dscp_prio (pydblp.dscp.prio_table) */
#define DBLP_NDSCP          64
struct dblp_host_cfg {
	__u16 port;                 /* UDP destination port of DBLP traffic */
	__u16 classify;             /* DBLP_CLASSIFY_* */
	__u32 rate_pps;             /* > 0: raise pressure from the arrival rate */
	__u32 shed_at[DBLP_MAX_PRIO + 1]; /* shed prio p when pressure >= shed_at[p] */
	__u8  dscp_prio[DBLP_NDSCP];      /* DSCP -> prio under DBLP_CLASSIFY_DSCP (0: never shed) */
};

/* Anti-spoofing: where a registered job's rank sends from.  A packet claiming
 * src rank R of job J, when (J, R) has an entry, must come from its IP
 * (family 4: ip[0..3] is the IPv4 address; 6: all 16 bytes; 0: not checked)
 * and, with has_mac, its Ethernet source address; else it is dropped. */
#define DBLP_MAX_PEERS 4096

struct dblp_peer_key {
	__u32 job;
	__u16 rank;
	__u16 pad;
};

struct dblp_peer {
	__u8 ip[16];
	__u8 mac[6];
	__u8 family;   /* 4, 6, or 0: no IP check */
	__u8 has_mac;  /* 1: check the Ethernet source too */
};

#ifdef __KERNEL__  /* the BPF side (bcc builds with kernel headers) */
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>

/* The frame's length.  Programs loaded multi-buffer (-DDBLP_FRAGS=1, see
 * pydblp.bpf.compile_xdp) get jumbo frames in fragments: data_end bounds
 * the first only, which always holds the headers. */
static __always_inline __u64 dblp_frame_len(struct xdp_md *ctx)
{
#if DBLP_FRAGS
	return bpf_xdp_get_buff_len(ctx);
#else
	return ctx->data_end - ctx->data;
#endif
}

/* ---- header parsing, shared by the programs ----
 *
 * A cursor walks the frame one header at a time, in the manner of xdp-tools'
 * parsing_helpers.h.  Each parse_* checks that its whole header lies before
 * data_end before reading any of it; then it moves the cursor past the
 * header, points *hdr at it (where it has one) and returns the next protocol
 * as the header carries it (network order), UDP its length field instead.
 * A header not there whole returns -1 and leaves the cursor and *hdr alone.
 * No loops: one VLAN tag at most, IPv4 options skipped by IHL, no IPv6
 * extension headers (a next header other than UDP is not DBLP). */
struct hdr_cursor {
	void *pos;
};

/* an 802.1Q / 802.1ad tag, after the Ethernet addresses */
struct vlan_tag {
	__be16 tci;
	__be16 proto;
};

/* Ethernet header: returns its EtherType. */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end, struct ethhdr **hdr)
{
	struct ethhdr *eth = nh->pos;

	if ((void *)(eth + 1) > data_end)
		return -1;
	nh->pos = eth + 1;
	*hdr = eth;
	return eth->h_proto;
}

/* An EtherType announcing a VLAN tag: 802.1Q or 802.1ad. */
static __always_inline int proto_is_vlan(int proto)
{
	return proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD);
}

/* One VLAN tag: returns the EtherType it encloses. */
static __always_inline int parse_vlanhdr(struct hdr_cursor *nh, void *data_end)
{
	struct vlan_tag *vh = nh->pos;

	if ((void *)(vh + 1) > data_end)
		return -1;
	nh->pos = vh + 1;
	return vh->proto;
}

/* IPv4 header with its options: returns its protocol; -1 also for IHL < 5. */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end, struct iphdr **hdr)
{
	struct iphdr *ip = nh->pos;
	__u32 hdrsize;

	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl < 5)
		return -1;
	hdrsize = ip->ihl * 4;
	if (nh->pos + hdrsize > data_end)
		return -1;
	nh->pos += hdrsize;
	*hdr = ip;
	return ip->protocol;
}

/* More fragments or a fragment offset: no L4 header here, or not all of it. */
static __always_inline int ipv4_is_fragment(const struct iphdr *ip)
{
	return (ip->frag_off & bpf_htons(0x3fff)) != 0;  /* IP_MF | IP_OFFSET */
}

/* IPv6 fixed header: returns its next header. */
static __always_inline int parse_ip6hdr(struct hdr_cursor *nh, void *data_end, struct ipv6hdr **hdr)
{
	struct ipv6hdr *ip6 = nh->pos;

	if ((void *)(ip6 + 1) > data_end || ip6->version != 6)
		return -1;
	nh->pos = ip6 + 1;
	*hdr = ip6;
	return ip6->nexthdr;
}

/* UDP header: returns its length field (header and payload, host order). */
static __always_inline int parse_udphdr(struct hdr_cursor *nh, void *data_end, struct udphdr **hdr)
{
	struct udphdr *udp = nh->pos;

	if ((void *)(udp + 1) > data_end)
		return -1;
	nh->pos = udp + 1;
	*hdr = udp;
	return bpf_ntohs(udp->len);
}

/* What the programs keep of an IP header. */
struct l3_info {
	__u32 saddr[4];  /* source address as big-endian words: IPv4 in saddr[0], the rest untouched */
	__u32 l4len;     /* bytes the IP header says follow it (IPv4: total length - header; IPv6: payload) */
	__u8 family;     /* 4 or 6 */
	__u8 dscp;       /* 0..63 */
	__u8 vlan;       /* 1: behind a VLAN tag */
};

/* The IPv4 or IPv6 header at the cursor, after EtherType `proto`: returns
 * the protocol it carries, or -1 for another EtherType, a header not there
 * whole, or an IPv4 fragment (left to the stack to reassemble); fills *info. */
static __always_inline int parse_ip(struct hdr_cursor *nh, void *data_end, int proto, struct l3_info *info)
{
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip;

		proto = parse_iphdr(nh, data_end, &ip);
		if (proto < 0 || ipv4_is_fragment(ip))
			return -1;
		info->saddr[0] = ip->saddr;
		__u32 tot = bpf_ntohs(ip->tot_len), hl = ip->ihl * 4;
		info->l4len = tot > hl ? tot - hl : 0;
		info->family = 4;
		info->dscp = ip->tos >> 2;
		return proto;
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6;

		proto = parse_ip6hdr(nh, data_end, &ip6);
		if (proto < 0)
			return -1;
		__builtin_memcpy(info->saddr, &ip6->saddr, sizeof(info->saddr));
		info->l4len = bpf_ntohs(ip6->payload_len);
		info->family = 6;
		info->dscp = (ip6->priority << 2) | (ip6->flow_lbl[0] >> 6);
		return proto;
	}
	return -1;
}
#endif /* __KERNEL__ */

#endif /* DBLP_H */
