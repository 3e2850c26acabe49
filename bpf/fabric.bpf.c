// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Testbed fabric: the switch of an emulated cluster misbehaving on purpose.
 *
 * Attached (native XDP) to every switch-side veth port of a testbed; one
 * loaded object serves all ports of that testbed.  A port's XDP program sees
 * the frames its worker sends, so faults are applied per EGRESS port, found
 * from the destination MAC through `fdb` (filled by userspace): a fault set on
 * port wK acts on frames the switch delivers to worker K, and a frame crosses
 * exactly one egress port, so it meets each configured fault once.
 *
 * Per frame, in order: microburst window, Bernoulli loss, Gilbert-Elliott
 * loss, then the virtual queue of the egress port (token bucket draining at
 * `rate` bytes/s, `buffer` bytes deep): tail drop beyond the buffer, and below
 * it DBLP-priority-aware early drop (prio p dropped once the backlog would
 * pass thresh[p]; prio 0 and non-DBLP traffic never; with FABRIC_F_DSCP p is
 * the IP header's DSCP through dscp_prio, as a DiffServ switch ranks it), at most
 * floor(nchunks * tol / 255) early drops per message (job, round, tensor,
 * src, dst, all-gather or not).  An ECN-capable frame (ECT(0) or ECT(1), any
 * IPv4/IPv6 protocol) the queue admits while the backlog would pass `mark` is
 * set to CE (RFC 3168), as an AQM switch marks instead of dropping; with
 * FABRIC_F_MARK_DROP an IP frame that cannot be marked (Not-ECT) is dropped
 * there instead, as such a switch signals a flow without ECN.  The
 * virtual queue decides drops and marks; it cannot hold a frame.  With
 * FABRIC_F_DELAY a unicast frame it admits goes up to the Linux bridge
 * (XDP_PASS), and the port's qdisc, a TBF at the same rate that userspace
 * sets, delays it: a real queue, which the virtual one shadows to mark and
 * drop.  TCP, UDP and everything else unicast are treated alike.  Otherwise a
 * frame that survives is forwarded by XDP_REDIRECT to its egress port (a
 * switch in XDP: no skb, bridge or netfilter work per frame); what the fdb
 * does not know goes up to the bridge with XDP_PASS.
 *
 * Broadcast and multicast frames: DBLP DATA to every rank (dst DBLP_DST_ALL,
 * a broadcast all-gather) is replicated here to every other port through the
 * devmap `bcast` (BPF_F_BROADCAST), whose egress program `fabric_egress`
 * applies each port's faults to its own copy, as for unicast; everything
 * else (ARP, ...) goes up to the bridge untouched (FLOOD on the ingress port).
 */
#include <uapi/linux/bpf.h>
#include "dblp.h"  /* with the header parsing helpers (parse_ethhdr, parse_ip, ...) */
#include "fabric.h"

BPF_HASH(port_cfg, u32, struct fabric_cfg, FABRIC_MAX_PORTS);
BPF_HASH(port_state, u32, struct fabric_state, FABRIC_MAX_PORTS);
BPF_HASH(fdb, struct fabric_mac, u32, FABRIC_MAX_PORTS);
BPF_PERCPU_HASH(counters, struct fabric_ckey, struct fabric_cval, FABRIC_MAX_PORTS * FABRIC_NCAUSES);
BPF_TABLE("lru_hash", struct fabric_msg, u32, msgs, FABRIC_MSG_ENTRIES);
/* every port, with fabric_egress as its program: broadcast DBLP DATA goes to all but the ingress */
BPF_XDP_REDIRECT_MAP("devmap", struct bpf_devmap_val, bcast, FABRIC_MAX_PORTS);

static __always_inline void count(u32 ifindex, u32 cause, u64 bytes)
{
	struct fabric_ckey k = {.ifindex = ifindex, .cause = cause};
	struct fabric_cval *v = counters.lookup(&k);

	if (!v) {
		struct fabric_cval zero = {};
		counters.insert(&k, &zero);
		v = counters.lookup(&k);
		if (!v)
			return;
	}
	v->packets += 1;
	v->bytes += bytes;
}

static __always_inline int chance(u64 p)
{
	return p && (u64)bpf_get_prandom_u32() < p;
}

/* DBLP DATA header of the UDP/IPv4|IPv6 frame at data (at most one VLAN tag), or NULL; *dscp is then
 * its IP header's DSCP. */
static __always_inline struct dblp_hdr *dblp_of(void *data, void *data_end, u32 *dscp)
{
	struct hdr_cursor nh = { .pos = data };
	struct l3_info l3 = {};
	struct ethhdr *eth;
	struct udphdr *udp;
	struct dblp_hdr *h;
	int proto;

	proto = parse_ethhdr(&nh, data_end, &eth);
	if (proto < 0)
		return NULL;
	if (proto_is_vlan(proto))
		proto = parse_vlanhdr(&nh, data_end);
	proto = parse_ip(&nh, data_end, proto, &l3);
	if (proto != IPPROTO_UDP || parse_udphdr(&nh, data_end, &udp) < 0)
		return NULL;
	h = nh.pos;
	if ((void *)(h + 1) > data_end)
		return NULL;
	if (h->magic != bpf_htons(DBLP_MAGIC) || h->version != DBLP_VERSION || h->kind != DBLP_KIND_DATA)
		return NULL;
	*dscp = l3.dscp;
	return h;
}

/* ECN field (RFC 3168): the low two bits of the IPv4 TOS byte and of the IPv6 traffic class. */
#define ECN_MASK 3
#define ECN_CE   3

/* The fixed IPv4 or IPv6 header of the frame at data (Ethernet, at most one VLAN tag), bounds
 * checked; *v6 says which.  NULL: neither (or truncated). */
static __always_inline void *ip_of(void *data, void *data_end, int *v6)
{
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	int proto = parse_ethhdr(&nh, data_end, &eth);

	if (proto_is_vlan(proto))
		proto = parse_vlanhdr(&nh, data_end);
	*v6 = proto == bpf_htons(ETH_P_IPV6);
	if (proto == bpf_htons(ETH_P_IP) && nh.pos + sizeof(struct iphdr) <= data_end)
		return nh.pos;
	if (*v6 && nh.pos + sizeof(struct ipv6hdr) <= data_end)
		return nh.pos;
	return NULL;
}

/* The ECN field of the header ip_of found: 0 Not-ECT, 1 ECT(1), 2 ECT(0), 3 CE.  The IPv6
 * traffic class is the low nibble of byte 0 and the high nibble of byte 1 (flow_lbl[0]): its
 * ECN bits are flow_lbl[0] & 0x30. */
static __always_inline int ecn_at(void *l3, int v6)
{
	if (v6)
		return (((struct ipv6hdr *)l3)->flow_lbl[0] >> 4) & ECN_MASK;
	return ((struct iphdr *)l3)->tos & ECN_MASK;
}

/* The ECN field of the frame at data; -1 if it is not IP. */
static __always_inline int ecn_of(void *data, void *data_end)
{
	int v6;
	void *l3 = ip_of(data, data_end, &v6);

	return l3 ? ecn_at(l3, v6) : -1;
}

/* Set the ECN field of the IPv4/IPv6 frame at data to CE if it is ECT(0) or ECT(1): 1 if
 * marked; 0 (the frame untouched) if it is not IP, Not-ECT or CE already.  Only the fixed
 * header is read and written, after its bounds check. */
static __always_inline int mark_ce(void *data, void *data_end)
{
	int v6;
	void *l3 = ip_of(data, data_end, &v6);

	if (!l3)
		return 0;
	int ecn = ecn_at(l3, v6);
	if (ecn == 0 || ecn == ECN_CE)
		return 0;
	if (v6) {
		struct ipv6hdr *ip6 = l3;

		ip6->flow_lbl[0] |= ECN_CE << 4;
		return 1;
	}
	struct iphdr *ip = l3;
	u8 tos = ip->tos;
	/* RFC 1624 eqn. 3, HC' = ~(~HC + ~m + m'), m the 16-bit word holding the TOS byte
	 * (version/IHL, TOS), in host order on both sides */
	u32 m = ((u32)(*(u8 *)ip) << 8) | tos;
	u32 sum = (~(u32)bpf_ntohs(ip->check) & 0xffff) + (~m & 0xffff) + (m | ECN_CE);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	ip->tos = tos | ECN_CE;
	ip->check = bpf_htons((u16)~sum);
	return 1;
}

/* Burst window armed on this port and `now` inside one. */
static __always_inline int in_burst(struct fabric_cfg *cfg, u64 now)
{
	u64 off;

	if (!cfg->burst_dur_ns || now < cfg->burst_start_ns)
		return 0;
	off = now - cfg->burst_start_ns;
	if (cfg->burst_period_ns) {
		if (cfg->burst_count && off / cfg->burst_period_ns >= cfg->burst_count)
			return 0;
		off = off % cfg->burst_period_ns;
	}
	return off < cfg->burst_dur_ns;
}

/* Apply egress port `out_if`'s faults to a frame: 0 forward it (set to CE
 * first if the queue admitted it past its mark and it is ECN-capable), 2 the
 * same through the port's delaying qdisc (FABRIC_F_DELAY), 1 drop it (counted
 * either way), -1 the port has no state (forward, counted PASS).
 * `bcast`: a copy of a broadcast frame (its early-drop budget is per port). */
static __always_inline int faults(struct ethhdr *eth, void *data_end, u64 len, u32 out_if, int bcast)
{
	struct fabric_cfg *cfg = port_cfg.lookup(&out_if);
	struct fabric_state *st = port_state.lookup(&out_if);
	if (!cfg || !st) {
		count(out_if, FABRIC_C_PASS, len);
		return -1;
	}
	u64 now = bpf_ktime_get_ns();

	if (in_burst(cfg, now) && chance(cfg->burst_ratio)) {
		count(out_if, FABRIC_C_BURST, len);
		return 1;
	}
	if (chance(cfg->loss)) {
		count(out_if, FABRIC_C_LOSS, len);
		return 1;
	}
	if (cfg->flags & FABRIC_F_GE) {
		u32 bad = st->ge_bad;

		if (bad ? chance(cfg->ge_r) : chance(cfg->ge_p))
			bad = !bad;
		st->ge_bad = bad;
		if (chance(bad ? cfg->ge_loss_bad : cfg->ge_loss_good)) {
			count(out_if, FABRIC_C_GE, len);
			return 1;
		}
	}
	if (!(cfg->flags & FABRIC_F_QUEUE)) {
		count(out_if, FABRIC_C_PASS, len);
		return 0;
	}

	/* Virtual queue.  Early-drop candidates: DBLP DATA with prio > 0 and a
	 * non-zero bound.  The message counter is found before taking the port
	 * lock (no helper calls under it) and claimed under it: a message (a
	 * broadcast one: its copy to this port) has a single egress port, so its
	 * counter is only touched under this lock. */
	u32 d = 0;
	struct dblp_hdr *h = dblp_of(eth, data_end, &d);
	u32 prio = 0, *spent = NULL;
	u64 thresh = 0, bound = 0;
	if (h && (cfg->flags & FABRIC_F_DSCP)) {  /* as a DiffServ switch sees it; the bound stays DBLP's */
		/* the DSCP is <= 63, so clang drops the mask; Linux 6.1's verifier loses the bounds at
		 * the IPv6 path's `|` of two registers and refuses the index unmasked: hide the value
		 * from clang so the mask stays (dblp_host.bpf.c does the same) */
		asm volatile("" : "+r"(d));
		prio = cfg->dscp_prio[d & (FABRIC_NDSCP - 1)];
	}
	else if (h && h->prio < FABRIC_NPRIO)
		prio = h->prio;
	if (h && prio > 0 && prio < FABRIC_NPRIO && !(h->flags & DBLP_FLAG_RETX)) {  /* a retransmission: never */
		thresh = cfg->thresh[prio & (FABRIC_NPRIO - 1)];
		bound = (u64)bpf_ntohl(h->nchunks) * h->tol / DBLP_TOL_SCALE;
	}
	if (thresh && bound) {
		struct fabric_msg key = {
			.job = h->job, .round = h->round, .tensor = h->tensor,
			.src = h->src, .dst = h->dst, .port = bcast ? (u16)out_if : 0,
			.allgather = (h->flags & DBLP_FLAG_ALLGATHER) ? 1 : 0, .pad = 0,
		};
		spent = msgs.lookup(&key);
		if (!spent) {
			u32 zero = 0;
			msgs.insert(&key, &zero);
			spent = msgs.lookup(&key);
		}
	}
	u64 rate = cfg->rate, buffer = cfg->buffer, mark = cfg->mark;
	int verdict;  /* 0 admit, 1 tail drop, 2 early drop, 3 admit: bound spent, 4 mark drop */
	int ce = 0;   /* admitted past the mark: set CE if ECN-capable */
	/* an AQM's mark: past it, what cannot be marked is dropped (parsed before the lock) */
	int unmarkable = mark && (cfg->flags & FABRIC_F_MARK_DROP) && ecn_of(eth, data_end) == 0;

	bpf_spin_lock(&st->lock);
	u64 dt = now > st->last_ns ? now - st->last_ns : 0;
	u64 backlog = st->backlog;
	u64 drained = dt < 1000000000ULL ? dt * rate / 1000000000ULL : backlog;
	if (backlog > drained && rate) {
		backlog -= drained;
		/* advance time only by what was drained: keep the remainder */
		st->last_ns += drained * 1000000000ULL / rate;
	} else {
		backlog = 0;
		st->last_ns = now;
	}
	if (backlog + len > buffer) {
		verdict = 1;
	} else if (thresh && backlog + len > thresh && spent && *spent < bound) {
		*spent += 1;
		verdict = 2;
	} else if (unmarkable && backlog + len > mark) {
		verdict = 4;
	} else {
		verdict = (thresh && backlog + len > thresh) ? 3 : 0;
		ce = mark && backlog + len > mark;
		backlog += len;
		if (backlog > st->peak)
			st->peak = backlog;
	}
	st->backlog = backlog;
	bpf_spin_unlock(&st->lock);

	if (verdict == 1) {
		count(out_if, FABRIC_C_TAIL, len);
		return 1;
	}
	if (verdict == 2) {
		count(out_if, FABRIC_C_EARLY + prio, len);
		return 1;
	}
	if (verdict == 4) {
		count(out_if, FABRIC_C_MARK_DROP, len);
		return 1;
	}
	if (verdict == 3)
		count(out_if, FABRIC_C_BOUND, len);
	if (ce && mark_ce(eth, data_end))
		count(out_if, FABRIC_C_MARK, len);
	count(out_if, FABRIC_C_PASS, len);
	return (cfg->flags & FABRIC_F_DELAY) ? 2 : 0;
}

/* Ingress of every port: unicast by the fdb, broadcast DBLP DATA to the devmap. */
int fabric(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	u64 len = dblp_frame_len(ctx);
	u32 in_if = ctx->ingress_ifindex;

	if (parse_ethhdr(&nh, data_end, &eth) < 0)
		return XDP_PASS;

	struct fabric_mac mac = {};
	__builtin_memcpy(mac.addr, eth->h_dest, ETH_ALEN);
	if (mac.addr[0] & 1) {
		u32 dscp;
		struct dblp_hdr *h = dblp_of(eth, data_end, &dscp);

		if (h && h->dst == bpf_htons(DBLP_DST_ALL))
			return bcast.redirect_map(0, BPF_F_BROADCAST | BPF_F_EXCLUDE_INGRESS);
		count(in_if, FABRIC_C_FLOOD, len);
		return XDP_PASS;
	}
	u32 *egress = fdb.lookup(&mac);
	if (!egress) {
		count(in_if, FABRIC_C_FLOOD, len);
		return XDP_PASS;
	}
	u32 out_if = *egress;
	int verdict = faults(eth, data_end, len, out_if, 0);
	if (verdict == 1)
		return XDP_DROP;
	if (verdict)  /* no state, or the bridge's fdb takes it to the delaying qdisc */
		return XDP_PASS;
	return bpf_redirect(out_if, 0);
}

/* Egress of a broadcast copy (the devmap's program): that port's faults; a
 * copy is never delayed (XDP_PASS here transmits it). */
int fabric_egress(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = { .pos = (void *)(long)ctx->data };
	struct ethhdr *eth;

	if (parse_ethhdr(&nh, data_end, &eth) < 0)
		return XDP_PASS;
	return faults(eth, data_end, dblp_frame_len(ctx), ctx->egress_ifindex, 1) == 1 ? XDP_DROP : XDP_PASS;
}
