// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Host XDP program: validate DBLP packets, shed within the loss bound under
 * pressure, steer the rest to the AF_XDP socket of the rx queue.
 *
 * Ethernet (+ one 802.1Q/802.1ad tag) -> IPv4|IPv6 -> UDP to cfg.port -> DBLP.
 * Non-DBLP traffic passes untouched; malformed DBLP is dropped and counted.
 */
#include <uapi/linux/bpf.h>
#include "dblp.h"  /* with the header parsing helpers (parse_ethhdr, parse_ip, ...) */

BPF_ARRAY(config, struct dblp_host_cfg, 1);
/* the pressure level userspace writes, 0..DBLP_PRESSURE_MAX: a map of its own, so the receiver's
 * frequent writes never overwrite a `dblp config` made meanwhile */
BPF_ARRAY(pressure, u32, 1);
BPF_HASH(jobs, u32, struct dblp_job, DBLP_MAX_JOBS);
BPF_XSKMAP(xsks, DBLP_MAX_QUEUES);
/* packets shed per message (see shed_charge); u64 because the BPF backend of bcc's LLVM
 * (no alu32) returns the old value of an atomic add for 64-bit words only */
BPF_TABLE("lru_hash", struct dblp_msg_key, u64, shed, DBLP_SHED_ENTRIES);
BPF_PERCPU_ARRAY(counters, u64, DBLP_CNT_MAX);
/* per-CPU arrival window for the in-kernel rate estimate: [start ns, count] */
BPF_PERCPU_ARRAY(rate, u64, 2);
/* Valid DBLP control packets (PROBE, BITMAP, STOP...) of AF_XDP jobs, counted before their
 * redirect and read by userspace through mmap: a receive lingering for data returns once one
 * comes (it wants an answer) */
BPF_F_TABLE("array", u32, u64, ctrl_seen, 1, BPF_F_MMAPABLE);
/* (job, rank) -> the source addresses that rank's packets must come from (anti-spoofing) */
BPF_HASH(peers, struct dblp_peer_key, struct dblp_peer, DBLP_MAX_PEERS);

#define RATE_WINDOW_NS 1000000ULL

static __always_inline void count(u32 slot)
{
	u64 *c = counters.lookup(&slot);
	if (c)
		*c += 1;
}

static __always_inline int drop(u32 reason)
{
	count(DBLP_CNT_DROP_BASE + reason);
	return XDP_DROP;
}

/* The pressure a valid packet meets: the userspace level, raised by this CPU's arrival rate if
 * rate_pps is set.  Every valid DBLP packet counts as an arrival.  Up to rate_pps the rate adds
 * nothing; past it the pressure grows with the excess, full at twice the rate. */
static __always_inline u32 pressure_now(struct dblp_host_cfg *cfg)
{
	u32 zero = 0, k1 = 1;
	u32 *lvl = pressure.lookup(&zero);
	u32 level = lvl ? *lvl : 0;
	u64 *start, *n, now;

	if (!cfg->rate_pps)
		return level;
	start = rate.lookup(&zero);
	n = rate.lookup(&k1);
	if (!start || !n)
		return level;
	now = bpf_ktime_get_ns();
	if (now - *start >= RATE_WINDOW_NS) {
		*start = now;
		*n = 0;
	}
	*n += 1;
	/* arrivals this window past what rate_pps allows in one (>= 1: userspace refuses 1..999) */
	u64 allowed = (u64)cfg->rate_pps * RATE_WINDOW_NS / 1000000000ULL;
	if (!allowed)
		allowed = 1;
	if (*n <= allowed)
		return level;
	u64 est = (*n - allowed) * DBLP_PRESSURE_MAX / allowed;
	if (est > DBLP_PRESSURE_MAX)
		est = DBLP_PRESSURE_MAX;
	return est > level ? est : level;
}

/* Charge one shed packet to message `key` if its budget allows; 1 = charged, shed it.
 *
 * The counter is created insert-if-absent (BPF_NOEXIST): CPUs that miss at once
 * all end up on the one element, never on a fresh zero that replaced another's
 * charges.  A charge is an atomic add whose returned value decides: a CPU that
 * got old < budget sheds, one that got old >= budget takes its unit back and
 * does not.  The counter is (packets shed) + (units in flight, about to be taken
 * back), so a CPU that sheds got old >= (packets shed before it): every shed
 * packet sees fewer than `budget` before it, and at most `budget` are shed per
 * message while its entry lives (an entry the LRU evicts, among the least recently
 * used of DBLP_SHED_ENTRIES messages, starts again from zero). */
static __always_inline int shed_charge(struct dblp_msg_key *key, u32 budget)
{
	u64 *spent = shed.lookup(key);

	if (!spent) {
		u64 none = 0;

		shed.insert(key, &none);  /* BPF_NOEXIST: fails harmlessly if another CPU made it */
		spent = shed.lookup(key);
		if (!spent)
			return 0;
	}
	if (*(volatile u64 *)spent >= budget)  /* spent already: no atomic traffic */
		return 0;
	if (__sync_fetch_and_add(spent, 1) < budget)
		return 1;
	__sync_fetch_and_add(spent, -1);
	return 0;
}

/* Anti-spoofing: DBLP_REASON_OK unless (job, src) is bound to addresses other
 * than the packet's source (sip: its source IP as 4 big-endian words, IPv4 in
 * sip[0]; fam 4 or 6). */
static __always_inline u32 spoofed(u32 jobid, u16 src, const u8 *smac, const u32 *sip, u8 fam)
{
	struct dblp_peer_key key = { .job = jobid, .rank = src, .pad = 0 };
	struct dblp_peer *p = peers.lookup(&key);
	u32 want[4];

	if (!p)
		return DBLP_REASON_OK;
	if (p->family) {
		__builtin_memcpy(want, p->ip, sizeof(want));
		if (p->family != fam || want[0] != sip[0] ||
		    (fam == 6 && (want[1] != sip[1] || want[2] != sip[2] || want[3] != sip[3])))
			return DBLP_REASON_SPOOF_IP;
	}
	if (p->has_mac && (p->mac[0] != smac[0] || p->mac[1] != smac[1] || p->mac[2] != smac[2] ||
			   p->mac[3] != smac[3] || p->mac[4] != smac[4] || p->mac[5] != smac[5]))
		return DBLP_REASON_SPOOF_MAC;
	return DBLP_REASON_OK;
}

/* The DBLP header at h, the payload of a UDP datagram of length field `ulen`:
 * DBLP_REASON_OK if it is whole, well-formed and self-consistent, else why not. */
static __always_inline u32 check_header(struct xdp_md *ctx, struct dblp_hdr *h, void *data_end, u32 ulen)
{
	void *data = (void *)(long)ctx->data;
	u32 plen = ulen;

	if (plen < sizeof(struct udphdr) + DBLP_HEADER_LEN || (void *)(h + 1) > data_end)
		return DBLP_REASON_SHORT;
	plen -= sizeof(struct udphdr);
	if ((void *)h - data + plen > dblp_frame_len(ctx))
		return DBLP_REASON_SHORT;
	if (h->magic != bpf_htons(DBLP_MAGIC))
		return DBLP_REASON_MAGIC;
	if (h->version != DBLP_VERSION)
		return DBLP_REASON_VERSION;
	if (h->kind < DBLP_KIND_DATA || h->kind > DBLP_KIND_HELLO)
		return DBLP_REASON_KIND;
	u32 taglen = (h->flags & DBLP_FLAG_TAG) ? DBLP_TAG_LEN : 0;
	if (bpf_ntohs(h->len) + DBLP_HEADER_LEN + taglen != plen)
		return DBLP_REASON_LENGTH;
	u32 nchunks = bpf_ntohl(h->nchunks);
	if (nchunks == 0 || nchunks > DBLP_MAX_NCHUNKS)
		return DBLP_REASON_NCHUNKS;
	if (bpf_ntohl(h->chunk) >= nchunks)
		return DBLP_REASON_CHUNK;
	return DBLP_REASON_OK;
}

/* DBLP_REASON_OK if the packet's ranks fit `job` and it is for this host's rank, else why not. */
static __always_inline u32 check_ranks(const struct dblp_hdr *h, const struct dblp_job *job)
{
	u16 src = bpf_ntohs(h->src), dst = bpf_ntohs(h->dst);

	if (src >= job->world_size || (dst >= job->world_size && dst != DBLP_DST_ALL))
		return DBLP_REASON_RANK;
	/* DST_ALL: DATA broadcast to every rank; control packets name one */
	if (dst != job->rank && !(dst == DBLP_DST_ALL && h->kind == DBLP_KIND_DATA))
		return DBLP_REASON_DST;
	return DBLP_REASON_OK;
}

/* The priority a valid packet is shed at under pressure `level`, or 0 to keep it.
 *
 * Shed least important data first, never past the message's own budget.  The
 * priority comes from the DBLP header, or from the IP header's DSCP (as a switch
 * would see it; the budget still from the DBLP header). */
static __always_inline u32 shed_prio(struct dblp_host_cfg *cfg, const struct dblp_hdr *h, u8 dscp, u32 level)
{
	u8 prio = h->prio & DBLP_MAX_PRIO;
	u8 valid = h->prio <= DBLP_MAX_PRIO;

	if (cfg->classify == DBLP_CLASSIFY_DSCP) {
		/* dscp <= 63, so clang drops the mask; Linux 6.1's verifier loses the bounds at the
		 * IPv6 path's `|` of two registers and refuses the index unmasked ("math between
		 * map_value pointer and register with unbounded min value"): hide the value from
		 * clang so the mask stays */
		u32 di = dscp;
		asm volatile("" : "+r"(di));
		prio = cfg->dscp_prio[di & (DBLP_NDSCP - 1)] & DBLP_MAX_PRIO;
		valid = 1;
	}
	if (valid && prio > 0 && h->kind == DBLP_KIND_DATA &&
	    !(h->flags & DBLP_FLAG_RETX) && cfg->shed_at[prio] && level >= cfg->shed_at[prio]) {
		u32 budget = (u64)bpf_ntohl(h->nchunks) * h->tol / DBLP_TOL_SCALE;
		struct dblp_msg_key key = {
			.job = bpf_ntohl(h->job),
			.round = bpf_ntohl(h->round),
			.tensor = bpf_ntohs(h->tensor),
			.src = bpf_ntohs(h->src),
			.allgather = (h->flags & DBLP_FLAG_ALLGATHER) ? 1 : 0,
			.pad = 0,
		};
		if (budget && shed_charge(&key, budget))
			return prio;
	}
	return 0;
}

/* Hand a valid packet on (counted): to the stack for a UDP job, else to the
 * AF_XDP socket of the rx queue, or to the stack where the queue has none. */
static __always_inline int steer(struct xdp_md *ctx, const struct dblp_job *job, const struct dblp_hdr *h)
{
	if (job->transport == DBLP_JOB_TRANSPORT_UDP) {
		count(DBLP_CNT_DBLP_PASS);
		return XDP_PASS;
	}
	if (h->kind != DBLP_KIND_DATA) {
		u32 zero = 0;
		u64 *seen = ctrl_seen.lookup(&zero);

		if (seen)
			__sync_fetch_and_add(seen, 1);
	}
	int act = xsks.redirect_map(ctx->rx_queue_index, XDP_PASS);
	count(act == XDP_REDIRECT ? DBLP_CNT_REDIRECT : DBLP_CNT_NOSOCK);
	return act;
}

int dblp_host(struct xdp_md *ctx)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct hdr_cursor nh = { .pos = (void *)(long)ctx->data };
	struct l3_info l3 = {};  /* the IP source (anti-spoofing) and DSCP (shedding) */
	struct ethhdr *eth;
	struct udphdr *udp;
	struct dblp_hdr *h;
	struct dblp_job *job;
	u32 zero = 0, why, prio;
	int proto, ulen;

	struct dblp_host_cfg *cfg = config.lookup(&zero);
	if (!cfg)
		return XDP_PASS;

	/* Not DBLP unless Ethernet, one VLAN tag at most, IPv4 (no fragment: the
	 * stack reassembles) or IPv6, then UDP to cfg.port: such passes untouched. */
	proto = parse_ethhdr(&nh, data_end, &eth);
	if (proto < 0)
		goto pass;
	if (proto_is_vlan(proto)) {
		proto = parse_vlanhdr(&nh, data_end);
		l3.vlan = 1;
	}
	proto = parse_ip(&nh, data_end, proto, &l3);
	if (proto != IPPROTO_UDP)
		goto pass;
	ulen = parse_udphdr(&nh, data_end, &udp);
	if (ulen < 0 || udp->dest != bpf_htons(cfg->port))
		goto pass;

	/* From here on the packet claims to be DBLP: malformed or not for us, it is dropped. */
	h = nh.pos;
	/* the UDP datagram within what the IP header says it carries, and that within the frame */
	if ((u32)ulen > l3.l4len || (void *)udp - (void *)(long)ctx->data + l3.l4len > dblp_frame_len(ctx))
		return drop(DBLP_REASON_SHORT);
	why = check_header(ctx, h, data_end, ulen);
	if (why)
		return drop(why);
	u32 jobid = bpf_ntohl(h->job);
	job = jobs.lookup(&jobid);
	if (!job)
		return drop(DBLP_REASON_JOB);
	why = check_ranks(h, job);
	if (why)
		return drop(why);
	why = spoofed(jobid, bpf_ntohs(h->src), eth->h_source, l3.saddr, l3.family);
	if (why)
		return drop(why);

	if (l3.vlan && job->transport != DBLP_JOB_TRANSPORT_UDP)
		return drop(DBLP_REASON_VLAN);  /* the AF_XDP receivers parse untagged frames only */

	prio = shed_prio(cfg, h, l3.dscp, pressure_now(cfg));
	if (prio) {
		count(DBLP_CNT_SHED_BASE + prio);
		return XDP_DROP;
	}
	return steer(ctx, job, h);

pass:
	count(DBLP_CNT_PASS);
	return XDP_PASS;
}
