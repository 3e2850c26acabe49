// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Host XDP program: validate DBLP packets, shed within the loss bound under
 * pressure, steer the rest to the AF_XDP socket of the rx queue.
 *
 * Ethernet (+ one 802.1Q/802.1ad tag) -> IPv4|IPv6 -> UDP to cfg.port -> DBLP.
 * Non-DBLP traffic passes untouched; malformed DBLP is dropped and counted.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/udp.h>
#include "dblp.h"

struct vlan_hdr_ {
	__be16 tci;
	__be16 proto;
};

BPF_ARRAY(config, struct dblp_host_cfg, 1);
BPF_HASH(jobs, u32, struct dblp_job, DBLP_MAX_JOBS);
BPF_XSKMAP(xsks, DBLP_MAX_QUEUES);
BPF_TABLE("lru_hash", struct dblp_msg_key, u32, shed, DBLP_SHED_ENTRIES);
BPF_PERCPU_ARRAY(counters, u64, DBLP_CNT_MAX);
/* per-CPU arrival window for the in-kernel rate estimate: [start ns, count] */
BPF_PERCPU_ARRAY(rate, u64, 2);
/* Valid DBLP control packets (PROBE, BITMAP, STOP...) of AF_XDP jobs, counted before their
 * redirect and read by userspace through mmap: a receive lingering for data returns once one
 * comes (it wants an answer) */
BPF_F_TABLE("array", u32, u64, ctrl_seen, 1, BPF_F_MMAPABLE);

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

/* Pressure: the userspace level, raised by this CPU's arrival rate if enabled. */
static __always_inline u32 pressure(struct dblp_host_cfg *cfg)
{
	u32 level = cfg->pressure;
	u32 k0 = 0, k1 = 1;
	u64 *start, *n, now;

	if (!cfg->rate_pps)
		return level;
	start = rate.lookup(&k0);
	n = rate.lookup(&k1);
	if (!start || !n)
		return level;
	now = bpf_ktime_get_ns();
	if (now - *start >= RATE_WINDOW_NS) {
		*start = now;
		*n = 0;
	}
	*n += 1;
	/* arrivals this window vs what rate_pps allows in one window */
	u64 allowed = (u64)cfg->rate_pps * RATE_WINDOW_NS / 1000000000ULL;
	if (!allowed)
		allowed = 1;
	u64 est = *n * DBLP_PRESSURE_MAX / allowed;
	if (est > DBLP_PRESSURE_MAX)
		est = DBLP_PRESSURE_MAX;
	return est > level ? est : level;
}

int dblp_host(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct udphdr *udp;
	struct dblp_hdr *h;
	void *l3;
	u32 zero = 0;
	u16 proto;

	struct dblp_host_cfg *cfg = config.lookup(&zero);
	if (!cfg)
		return XDP_PASS;

	if ((void *)(eth + 1) > data_end)
		goto pass;
	proto = eth->h_proto;
	l3 = eth + 1;
	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD)) {
		struct vlan_hdr_ *vh = l3;
		if ((void *)(vh + 1) > data_end)
			goto pass;
		proto = vh->proto;
		l3 = vh + 1;
	}

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_UDP || ip->ihl < 5)
			goto pass;
		if (ip->frag_off & bpf_htons(0x3fff))  /* MF or offset: let the stack reassemble */
			goto pass;
		udp = (void *)ip + ip->ihl * 4;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		if ((void *)(ip6 + 1) > data_end || ip6->nexthdr != IPPROTO_UDP)
			goto pass;
		udp = (void *)(ip6 + 1);
	} else {
		goto pass;
	}
	if ((void *)(udp + 1) > data_end || udp->dest != bpf_htons(cfg->port))
		goto pass;

	/* From here on the packet claims to be DBLP. */
	u32 plen = bpf_ntohs(udp->len);
	h = (void *)(udp + 1);
	if (plen < sizeof(*udp) + DBLP_HEADER_LEN || (void *)(h + 1) > data_end)
		return drop(DBLP_REASON_SHORT);
	plen -= sizeof(*udp);
	if ((void *)h - data + plen > dblp_frame_len(ctx))
		return drop(DBLP_REASON_SHORT);
	if (h->magic != bpf_htons(DBLP_MAGIC))
		return drop(DBLP_REASON_MAGIC);
	if (h->version != DBLP_VERSION)
		return drop(DBLP_REASON_VERSION);
	if (h->kind < DBLP_KIND_DATA || h->kind > DBLP_KIND_HELLO)
		return drop(DBLP_REASON_KIND);
	u32 taglen = (h->flags & DBLP_FLAG_TAG) ? DBLP_TAG_LEN : 0;
	if (bpf_ntohs(h->len) + DBLP_HEADER_LEN + taglen != plen)
		return drop(DBLP_REASON_LENGTH);
	u32 nchunks = bpf_ntohl(h->nchunks);
	if (nchunks == 0 || nchunks > DBLP_MAX_NCHUNKS)
		return drop(DBLP_REASON_NCHUNKS);
	if (bpf_ntohl(h->chunk) >= nchunks)
		return drop(DBLP_REASON_CHUNK);
	u32 jobid = bpf_ntohl(h->job);
	struct dblp_job *job = jobs.lookup(&jobid);
	if (!job)
		return drop(DBLP_REASON_JOB);
	u16 src = bpf_ntohs(h->src), dst = bpf_ntohs(h->dst);
	if (src >= job->world_size || (dst >= job->world_size && dst != DBLP_DST_ALL))
		return drop(DBLP_REASON_RANK);
	/* DST_ALL: DATA broadcast to every rank; control packets name one */
	if (dst != job->rank && !(dst == DBLP_DST_ALL && h->kind == DBLP_KIND_DATA))
		return drop(DBLP_REASON_DST);

	/* Shed least important data first, never past the message's own budget. */
	u8 prio = h->prio & DBLP_MAX_PRIO;
	if (h->prio <= DBLP_MAX_PRIO && prio > 0 && h->kind == DBLP_KIND_DATA &&
	    !(h->flags & DBLP_FLAG_RETX) && cfg->shed_at[prio] &&
	    pressure(cfg) >= cfg->shed_at[prio]) {
		u32 budget = (u64)nchunks * h->tol / DBLP_TOL_SCALE;
		struct dblp_msg_key key = {
			.job = jobid,
			.round = bpf_ntohl(h->round),
			.tensor = bpf_ntohs(h->tensor),
			.src = src,
		};
		u32 *shed_n = shed.lookup(&key);
		if (!shed_n) {
			u32 none = 0;
			shed.update(&key, &none);
			shed_n = shed.lookup(&key);
		}
		if (shed_n && *shed_n < budget) {
			/* Reserve a unit, then re-read: a CPU that sees the count past
			 * the budget after its own add gives the unit back.  Every
			 * shedder saw count <= budget including itself, so at most
			 * budget packets of this message are ever shed. */
			__sync_fetch_and_add(shed_n, 1);
			if (*(volatile u32 *)shed_n <= budget) {
				count(DBLP_CNT_SHED_BASE + prio);
				return XDP_DROP;
			}
			__sync_fetch_and_add(shed_n, -1);
		}
	}

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

pass:
	count(DBLP_CNT_PASS);
	return XDP_PASS;
}
