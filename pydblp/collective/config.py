"""Knobs, records, errors and tuning constants of the bounded-loss collective.

What each constant times or bounds is described in docs/protocol.md.
"""

from __future__ import annotations

import time

from collections.abc import Callable
from dataclasses import dataclass, field

from pydblp import dscp, wire
from pydblp.collective import estimators, phase as phases

# plain ints: numpy compares an array with an IntEnum member ~4x slower than with an int
DATA, PROBE, BITMAP, STOP, HELLO = (int(k) for k in (wire.Kind.DATA, wire.Kind.PROBE, wire.Kind.BITMAP,
                                                      wire.Kind.STOP, wire.Kind.HELLO))
RAW, F32 = int(wire.Dtype.RAW), int(wire.Dtype.F32)
AG = int(wire.Flag.ALLGATHER)
FINAL = int(wire.Flag.FINAL)
ASK = int(wire.Flag.ASK)
NB = int(wire.Flag.NEIGHBOUR)
RETX = int(wire.Flag.RETX)
FEW = 8  # packets up to which a received batch is sorted one by one in Python
MASK32 = 0xFFFFFFFF
REAL_CLOCK = time.monotonic  # the one place the collective reads the real clock (Protocol's clock=)

# Tensor ids the library's own rounds use, one each; DDP buckets and a user's tensors take
# small ids (from 0).  Two users of one id in one job would take each other's packets.
TENSOR_BROADCAST = 0xFFFF  # pydblp.torch.ParameterBroadcaster's shard broadcasts
TENSOR_AGREE = 0xFFFE      # Collective.end_step: the ranks' partial gradient norms summed
TENSOR_SHARDED = 0xFFFD    # pydblp.torch.ShardedSGD / ShardedAdam: the step's round
TENSOR_DILOCO = 0xFFFC     # pydblp.torch.PydblpExchange: DiLoCo's outer rounds
TENSOR_WARM_UP = 0xFFFB    # Collective.warm_up: rounds of zeros before the first real one
TENSOR_BACKEND = (0x8000, 0x7000)  # pydblp.torch.backend: ids first .. first + count - 1, one per round shape
RESERVED_TENSORS = {TENSOR_BROADCAST: "ParameterBroadcaster", TENSOR_AGREE: "Collective.end_step",
                    TENSOR_SHARDED: "sharded optimizers", TENSOR_DILOCO: "PydblpExchange (DiLoCo)",
                    TENSOR_WARM_UP: "Collective.warm_up"}
STASH_MAX = 65536  # packets of the next rounds kept before they start
STASH_AHEAD = 64  # rounds ahead whose packets are kept (a rank behind in neighbour rounds catches up on them)
RECV_BATCH = 2048  # packets taken from the transport per receive call
DRAIN_READS = 8  # receives at most when taking in what has already arrived (a bound was reached)
NACK_QUIET = 0.002  # s of silence from a sender before a receiver that cannot reach the bound NACKs
IDLE_GRACE = 0.002  # s without a round before the idle responder serves the transport
LINGER, LINGER_WANT = 0.002, 256  # receive coalescing while a data stream trickles in
LINGER_MIN = 16  # fewer data packets due than this: a receive takes what is there
TIMER_TICK = 0.0005  # s between checks of the NACK, probe and peer timeouts
TIMEOUT_MAX = 86400.0  # s: the longest peer_timeout, join_timeout, probe_min or deadline (a day; waits are sums of them)
DEAD_TICK = 0.02  # s between dead-peer checks (peer_timeout is seconds)
# HELLOs a rank between rounds sends per peer_timeout to each peer waiting for it in a round, and asks
# a rank in a round sends per peer_timeout to a quiet peer: each is one packet that may be lost, and a
# peer is judged dead only when all of one peer_timeout's are (16 at 10 % loss each way: ~3e-12 a
# peer and timeout; 4 failed a simulated busy wait among 8 ranks at 20 % loss on every seed)
HELLO_EVERY = 16
JOIN_TIMEOUT = 1800.0  # s: Config.join_timeout's default (torch's default process-group timeout, 30 min)
TXQ_LIMIT = 0.002  # s of data a pacing transport may hold before more is handed to it (TCP small queues)
TXQ_REPAIR = 512 << 10  # bytes in the kernel's send queue past which a round that repairs hands it no more
TXQ_DRAINED = 64 << 10  # bytes in the send queue, soon after a full turn, up to which the path keeps up ...
TURN_GAP = 0.004  # ... if that turn began less than this many s ago (later, a link may have drained it)
DRAINED_LOOKS = 2  # looks in a row that must find so before turns grow (one holding data shrinks them)
TURN_DESTS = 4  # a turn on a path that keeps up sends up to burst to each of this many destinations
LOSS_RTTS = 1.5  # round trips after which a retransmission still missing from a BITMAP counts as lost
AG_SPLIT = 0.0025  # s an owner holds back the second half of its all-gather in a round that repairs
RECORDS_MAX = 4096  # round records a Collective keeps by default (Config.records_max)


CHUNK_MAX = 8000  # Config.check's bound
ALLGATHERS = ("unicast", "broadcast")
ORDERS = ("shuffle", "rows")
CCS = ("ecn", "off")
PLANS = ("auto", "on", "off")
PLAN_Z = 2.0          # standard deviations of the arrivals a plan adds to what the bound needs
PLAN_LOSS_MAX = 0.25  # a path that loses more than this is sent every chunk (no plan)
PLAN_SHORT_KEEP = 0.75  # a plan that fell short: the loss it saw counts for the next plans to that rank,
                        # this share less each


def link_chunk_bytes(mtu: int) -> int:
    """The largest ``Config.chunk_bytes`` a link of ``mtu`` carries in one datagram, over IPv4 or
    IPv6: ``mtu`` less the IPv6, UDP and DBLP headers, rounded down to a multiple of 64 bytes, at
    most 8000.  MTU 1500 gives the default 1408; MTU 9000 gives 8000.  Raises ValueError below 144.
    """
    least = 64 + wire.DATAGRAM_OVERHEAD
    if mtu < least:
        raise ValueError(f"mtu {mtu}: a DBLP chunk of 64 bytes needs an MTU of at least {least}")
    return min(CHUNK_MAX, (mtu - wire.DATAGRAM_OVERHEAD) // 64 * 64)


class CollectiveError(RuntimeError):
    """A round cannot complete: a peer is dead or unreachable, or the inputs disagree."""


@dataclass
class RoundRecord:
    """What one round did, kept in ``Collective.records`` (and handed to ``Config.on_record``)."""

    index: int
    round: int
    tensor: int
    tol: float
    phase: str
    latency: float
    delivered: dict = field(default_factory=dict)   # "rs:<src>" / "ag:<src>" / "nb:<src>" -> fraction received
    min_delivered: float = 1.0
    # retransmits and probes: of this round's messages while it ran; a trailing message's after
    # it returned are in counters["trail_retransmits"] and ["trail_probes"]
    retransmits: int = 0    # chunks resent
    probes: int = 0
    nacks: int = 0          # unsolicited BITMAPs this rank sent as a receiver
    bytes_sent: int = 0
    bytes_received: int = 0
    ce_received: int = 0    # DATA packets that arrived CE-marked (a switch's congestion mark) while it ran
    paced: int = 0          # destinations the congestion control paced as it ended (Config.cc)
    below_bound: bool = False
    left_out: list = field(default_factory=list)    # neighbour round: the neighbours skipped (timeout)


@dataclass
class Config:
    """Knobs of a collective; every rank must use the same mode, chunk size and job."""

    job: int = 1
    mode: str = "tar"                # "tar" (transpose allreduce) or "ps" (parameter server, rank 0)
    estimator: str = "unbiased"      # "zero" (sum/N) or "unbiased" (the arrived others' mean for the missing)
    consistent: bool = True          # every rank ends a round with the same result: all-gather
                                     # messages carry tolerance 0 and are repaired whole, so loss is
                                     # tolerated only in the reduce-scatter, whose estimate the owner
                                     # shares with all (False: the all-gather tolerates the round's
                                     # loss too and misses are filled per ``fill``: faster under loss,
                                     # but replicas drift apart)
    allgather_bound: bool = False    # consistent: in a round with a loss bound each owner's all-gather
                                     # carries only the first ``need`` rows of its (shuffled) shard, repaired
                                     # whole, and every rank, the owner too, fills the rest alike (``fill``):
                                     # the all-gather saves the bound's bytes and replicas stay identical.
                                     # Needs order "shuffle"; with fill "stale" the filled rows are last
                                     # round's mean (a tensor's first round goes whole), with "carry" they
                                     # are applied a round or more late.  Off by default: docs/protocol.md
    fill: str = "stale"              # all-gather misses (consistent=False, and rows past the all-gather's
                                     # bound): "stale" or "local"; or, past the all-gather's bound only,
                                     # "carry": zero on every rank, and the shard's owner adds the cut rows
                                     # to its next round's estimate (error feedback: applied late, not lost)
    error_feedback: bool = False     # a sender adds the rows of its reduce-scatter contribution an owner's
                                     # estimate left out (the owner says which: a FINAL BITMAP) to its next
                                     # round's contribution to that tensor: loss within the bound becomes
                                     # delay, not drop.  Needs estimator "zero" (with "unbiased" the others
                                     # were already scaled up for it: counted twice).  docs/protocol.md
    rotate: int = 0                  # rows per block of a random rotation of every reduce-scatter
                                     # contribution (a power of two; 0: none): a lost chunk becomes small
                                     # noise over its block (pydblp.collective.rotation)
    allgather: str = "unicast"       # "unicast" (a copy per rank) or "broadcast" (one copy to the
                                     # Collective's group address; the network replicates it)
    order: str = "shuffle"           # the rows' order in an allreduce's messages: "shuffle" (a permutation
                                     # of the tensor's chunks drawn per round, the same on every rank, so a
                                     # loss bound's cut and a burst fall on different chunks each round) or
                                     # "rows" (the tensor's order: a cut drops the same tail every round)
    stagger: bool = True             # each sender lays out its reduce-scatter and neighbour messages from
                                     # its own start (rank * n // world) round to the end and on from 0,
                                     # so a cut at the bound, or a paced stream stopped, leaves different
                                     # rows out of each sender's contribution, not the same tail of all
    priority: str = "magnitude"      # "magnitude", "position", "layer" (the model's structure, absolute:
                                     # Collective.set_layers / pydblp.torch.State.register_model) or "none"
    dscp: object = "off"             # DSCP per priority on the wire (pydblp.dscp): "off" (0, default),
                                     # "default" (the documented map: AF41/42/43 by priority band), or
                                     # {prio: dscp} / "PRIO=DSCP,..."; pydblp.torch opens the transport
                                     # with it.  Off by default: with magnitude priority the class changes
                                     # packet by packet and cuts UDP's GSO runs (1024-packet sends on
                                     # loopback 3.7 -> 1.3 Mpps, docs/wire.md); turn it on where switches
                                     # honour it
    phase: object = "static:0"       # a PhaseController or "static:TOL" / "dblp[:P_LOW]"
    chunk_bytes: int | None = 1408   # payload per packet (fits MTU 1500 over IPv4 and IPv6); None:
                                     # pydblp.torch.State picks the links' size (link_chunk_bytes)
    deadline: float | None = None    # seconds; a round may end below the bound only if set
                                     # (owners stop waiting for contributions at half of it)
    peer_timeout: float = 10.0       # a needed peer silent this long fails the round
    join_timeout: float = JOIN_TIMEOUT  # s a round waits for a needed peer that is alive but has not
                                     # joined it (busy between rounds: it says so with HELLO every
                                     # peer_timeout / HELLO_EVERY); pydblp.torch's backend sets it from
                                     # init_process_group(timeout=...).  docs/protocol.md, "Failure semantics"
    probe_min: float = 0.002         # probe timeout bounds (s); it adapts to measured STOP delays
    probe_max: float = 0.05
    burst: int = 1024                # packets sent per loop turn before draining receive; what every
                                     # sender has in flight must fit the receivers' rings (there is no
                                     # pacing): AF_XDP's 16384 receive frames by default.  On a path that
                                     # keeps up (no link limit) a turn sends up to burst to each of up to
                                     # TURN_DESTS destinations: docs/protocol.md, "The loop"
    spread: int = 0                  # where the link is the bottleneck, a send batch gives each destination
                                     # at most this many packets in a row, in turn (e.g. 32): a switch port
                                     # then takes each sender's share of its link, not several senders at
                                     # full rate, an incast a shallow port buffer drops; 0: each
                                     # destination's share in one run.  docs/protocol.md, "Switch ports"
    cc: str = "ecn"                  # congestion control per destination (pydblp.collective.cc): "ecn"
                                     # (DATA goes out ECT(0); receivers echo CE marks in their STOPs and
                                     # a sender whose packets were marked paces itself, DCTCP-style) or
                                     # "off".  Loss alone, marked by nothing, never slows a sender down:
                                     # bounded loss is for that.  docs/protocol.md, "Congestion control"
    cc_gain: float = 1.0             # weight of the newest marked fraction in the running one (DCTCP's g;
                                     # 1: an echo covers a whole message, hundreds of packets, not an RTT)
    cc_increase: float = 50e6        # bits/s a paced destination's rate grows per clean echo
    cc_min_rate: float = 10e6        # bits/s below which a destination is never paced
    cc_delay: float = 0.0            # s of STOP delay above the least seen counted as a mark (a fabric
                                     # without ECN that queues); 0: delay is not a signal
    plan: str = "off"                # how much of a message with a loss bound goes out before its sender
                                     # waits to hear from the receiver: "off": every chunk (the receiver's
                                     # STOP cuts the rest, a round trip late); "on": the chunks the bound
                                     # needs on the path's measured loss, with PLAN_Z deviations to spare,
                                     # then a PROBE (a shortfall is made up a round trip later); "auto": so
                                     # where the link is the bottleneck (a pacing transport, or a send queue
                                     # that does not drain) and the rate control does not pace the
                                     # destination, else every chunk.  Off by default: a plan spends
                                     # the bound's slack on purpose, so a clean path's rounds are estimates
                                     # too.  docs/protocol.md, "Plans"
    records_max: int = RECORDS_MAX   # round records Collective.records keeps (the latest; older ones
                                     # are dropped, so a long run's memory stays flat)
    on_record: Callable[[RoundRecord], None] | None = None  # called with each round's record as the
                                     # round ends (in the caller's thread; an exception it raises
                                     # propagates out of allreduce after the round's state is kept)

    def check(self) -> None:
        """Raise ValueError naming the first knob out of range (a :class:`Collective` checks its
        config before it registers any peer; ``pydblp.torch`` before it opens anything)."""
        for name, value, allowed in (("mode", self.mode, ("tar", "ps")),
                                     ("estimator", self.estimator, estimators.ESTIMATORS),
                                     ("fill", self.fill, estimators.FILLS),
                                     ("allgather", self.allgather, ALLGATHERS),
                                     ("priority", self.priority, estimators.PRIORITIES),
                                     ("order", self.order, ORDERS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: use {', '.join(allowed)}")
        if self.chunk_bytes is None:
            raise ValueError("chunk_bytes None: give a size (pydblp.torch.State.from_process_group picks one "
                             "from the links' MTU; link_chunk_bytes(mtu) computes it)")
        if self.chunk_bytes % 4 or not 64 <= self.chunk_bytes <= CHUNK_MAX:
            raise ValueError(f"chunk_bytes {self.chunk_bytes}: use a multiple of 4 in 64..{CHUNK_MAX}")
        if not 1 <= self.job <= 0xFFFFFFFF:
            raise ValueError(f"job {self.job}: use 1..{0xFFFFFFFF} (0 marks no job on the wire)")
        for name, value in (("peer_timeout", self.peer_timeout), ("join_timeout", self.join_timeout),
                            ("probe_min", self.probe_min),
                            ("deadline", 1.0 if self.deadline is None else self.deadline)):
            if not 0 < value <= TIMEOUT_MAX:  # (inf and NaN too: a wait that long overflows the clock)
                raise ValueError(f"{name} {value}: use a positive number of seconds, at most {TIMEOUT_MAX:g}")
        if self.probe_max < self.probe_min:
            raise ValueError(f"probe_max {self.probe_max} is below probe_min {self.probe_min}")
        if self.burst < 1:
            raise ValueError(f"burst {self.burst}: use 1 or more packets")
        if isinstance(self.spread, bool) or not isinstance(self.spread, int) or self.spread < 0:
            raise ValueError(f"spread {self.spread!r}: use 0 (off) or a number of packets, e.g. 32")
        if not isinstance(self.allgather_bound, bool):
            raise ValueError(f"allgather_bound {self.allgather_bound!r}: use True or False")
        if not isinstance(self.consistent, bool):
            raise ValueError(f"consistent {self.consistent!r}: use True (identical results) or False")
        if (getattr(self.phase, "window", False) and self.consistent and self.allgather_bound
                and self.fill == "stale"):
            raise ValueError("Dblp(g_over='window') sums each row over steps, and allgather_bound with fill "
                             "'stale' measures G on other rows each round: use g_over 'step' or fill 'carry'")
        if self.allgather_bound and getattr(self.phase, "hears_loss", False):
            # (each rank's own loss sets its bound, and an all-gather cut at its owner's bound then
            # has another length than its receivers expect: every packet of it would be refused)
            raise ValueError("Dblp(high='loss') gives each rank its own bound, and allgather_bound cuts the "
                             "all-gather at one every rank must share: use high='fixed', or allgather_bound=False")
        if self.fill == "carry" and not (self.consistent and self.allgather_bound):
            raise ValueError("fill 'carry' fills only rows past a consistent all-gather's bound: set consistent=True "
                             "and allgather_bound=True, or use fill 'stale' or 'local'")
        if not isinstance(self.stagger, bool):
            raise ValueError(f"stagger {self.stagger!r}: use True or False")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback {self.error_feedback!r}: use True or False")
        if self.error_feedback and self.estimator != "zero":
            raise ValueError("error_feedback re-sends what an estimate left out, which 'unbiased' already made up for "
                             "(counted twice): use estimator 'zero' with it")
        if not (isinstance(self.rotate, int) and self.rotate >= 0 and not self.rotate & (self.rotate - 1)):
            raise ValueError(f"rotate {self.rotate!r}: use rows per rotation block, a power of two (e.g. 16), or 0")
        if self.cc not in CCS:
            raise ValueError(f"cc {self.cc!r}: use {', '.join(CCS)}")
        if not 0 < self.cc_gain <= 1:
            raise ValueError(f"cc_gain {self.cc_gain}: use a weight in (0, 1] (DCTCP's is 1/16)")
        for name, value in (("cc_increase", self.cc_increase), ("cc_min_rate", self.cc_min_rate)):
            if not value > 0:
                raise ValueError(f"{name} {value}: use a positive rate in bits/s (e.g. 50e6)")
        if not self.cc_delay >= 0:
            raise ValueError(f"cc_delay {self.cc_delay}: use seconds >= 0 (0: delay is no signal)")
        if self.plan not in PLANS:
            raise ValueError(f"plan {self.plan!r}: use {', '.join(PLANS)}")
        if self.records_max < 0:
            raise ValueError(f"records_max {self.records_max}: use 0 or more records")
        if self.on_record is not None and not callable(self.on_record):
            raise ValueError(f"on_record {self.on_record!r}: give a callable taking a RoundRecord, or None")
        phases.make(self.phase)  # a bad phase spec or tolerance
        dscp.resolve(self.dscp)  # a bad DSCP map

    def check_group(self, group) -> None:
        """Raise ValueError unless ``group`` (Collective's) is given exactly when ``allgather`` is
        "broadcast"."""
        if (self.allgather == "broadcast") != (group is not None):
            raise ValueError("allgather 'broadcast' needs group=(address, port): an address every rank receives "
                             "(the subnet's broadcast address)" if group is None else
                             "group is used only with Config(allgather='broadcast')")
