"""One rank of the experiment: train with DDP over Gloo or pydblp, report JSON lines.

Run by :mod:`pydblp.experiment.runner` inside a testbed worker namespace (and
usable by hand under ``torchrun``: it reads RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT when the flags are absent).  Every line on stdout is one JSON
object: ``{"calibrate": seconds}`` once (forward + backward without
synchronisation, DDP's ``no_sync``: the step's compute), ``{"step", "t",
"loss", "sync", "dt", "opt"}`` per step (``sync``: seconds of backward +
gradient synchronisation, ``dt``: the whole step), ``{"eval", "metric",
"loss", ...}`` at evaluation points (``--eval-every`` steps, ``--eval-at`` and the last
step: ``loss`` the held-out cross-entropy, ``eval`` accuracy or perplexity beside it)
followed by ``{"div", ...}``: the largest parameter difference from rank 0's
over all ranks, measured through the Gloo control plane, and a final
``{"final", ...}`` with the collective's round records, every rank's phase
decisions, host-program counters and transport and collective counters.  ``t``
counts training only: evaluation and the divergence check are left out.
Failures go to stderr and the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pydblp.collective.config import CCS, PLANS
from pydblp.collective.phase import G_OVER, HIGH
from pydblp.experiment import data, models


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--master", default=f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                                       f"{os.environ.get('MASTER_PORT', '29500')}")
    p.add_argument("--arm", choices=["gloo", "static", "dblp"], default="dblp",
                   help="Gloo, or pydblp with a static tolerance or DBLP's")
    p.add_argument("--algo", choices=ALGOS, default="ddp",
                   help="ddp (DDP, pydblp through its comm hook) or fsdp (FSDP2's fully_shard over a "
                        "'dblp' process group; gloo's for the gloo arm)")
    p.add_argument("--via", choices=VIAS, default="hook",
                   help="ddp's pydblp runs: DDP's comm hook on a State (default), or a 'dblp' process group "
                        "DDP runs over as over any backend, no hook")
    p.add_argument("--net", choices=["udp", "xsk", "xsk-ktx"], default="udp", help="pydblp data plane")
    p.add_argument("--iface", help="data-plane interface (pydblp)")
    p.add_argument("--port", type=int, default=47800, help="data-plane UDP port (0: any free one)")
    p.add_argument("--model", choices=models.MODELS, default="digits")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, help="samples per rank and step (default 32; lm 4)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p-low", type=float, default=0.016, help="static tolerance; dblp's P_low")
    p.add_argument("--k", type=float, default=0.40, help="dblp's P_high - P_low")
    p.add_argument("--high", choices=HIGH, default="fixed", help="dblp's relaxed bound (pydblp Dblp.high)")
    p.add_argument("--freq", type=int, default=10, help="dblp measures G every FREQ steps")
    p.add_argument("--eta", type=float, default=0.5, help="dblp's critical threshold on |dG|/G")
    p.add_argument("--g-over", choices=G_OVER, default="step", help="dblp's G (pydblp Dblp.g_over)")
    p.add_argument("--consistency", default="allgather", help=f"{CONSISTENCY_USE} (see consistency())")
    p.add_argument("--estimator", choices=["zero", "unbiased"], default="unbiased")
    p.add_argument("--order", choices=["shuffle", "rows"], default="shuffle", help="pydblp Config.order")
    p.add_argument("--stagger", choices=["on", "off"], default="on", help="pydblp Config.stagger")
    p.add_argument("--spread", type=int, default=0, help="pydblp Config.spread")
    p.add_argument("--cc", choices=CCS, default="ecn", help="pydblp Config.cc (congestion control)")
    p.add_argument("--plan", choices=PLANS, default="auto", help="pydblp Config.plan")
    p.add_argument("--relax", choices=RELAX, default="none",
                   help="pydblp runs' relaxed rounds: none, ef (Config.error_feedback, estimator zero), rotate "
                        "(Config.rotate 16) or both")
    p.add_argument("--priority", choices=["magnitude", "layer", "none"], default="magnitude",
                   help="pydblp Config.priority (layer: from the model's structure)")
    p.add_argument("--mode", choices=["tar", "ps"], default="tar", help="pydblp Config.mode")
    p.add_argument("--allgather", choices=["unicast", "broadcast"], default="unicast", help="pydblp Config.allgather")
    p.add_argument("--group", help="JSON [address, port, mac] every rank receives (--allgather broadcast)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-at", type=int, action="append", default=[], help="also evaluate after this step")
    p.add_argument("--grad-error-every", type=int, default=0,
                   help="every N steps (pydblp runs) compare the averaged gradient with the exact mean (0: never)")
    p.add_argument("--warm-up", type=int, default=2,
                   help="pydblp runs over the hook or a sharded optimizer: exact rounds of zeros of the model's "
                        "size before the first step (State.warm_up; 0: none)")
    p.add_argument("--peer-timeout", type=float, default=30.0)
    p.add_argument("--align", metavar="DIR",
                   help="a directory every rank can reach (one host): ranks line up there after evaluations "
                        "and the calibration (HostBarrier) instead of in a Gloo barrier over the network")
    p.add_argument("--no-round-records", dest="round_records", action="store_false",
                   help="leave every round's record out of the final line (long runs: memory stays flat)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="the link's bits/s: the xsk transport paces at it (AF_XDP bypasses the TBF)")
    return p.parse_args(argv)


VIAS = ("hook", "backend")
RELAX = ("none", "ef", "rotate", "both")  # --relax: what a relaxed round does with what it leaves out
ROTATE_ROWS = 16  # Config.rotate of --relax rotate and both
HELDOUT_FRACTION = 0.4  # digits held out for evaluation (718 images; the data set has 1,797)


def relax_knobs(relax: str, estimator: str) -> dict:
    """The Config knobs of a ``--relax``: error feedback needs the ``zero`` estimator (what a
    round leaves out comes again later; ``unbiased`` would count it twice)."""
    ef, rot = relax in ("ef", "both"), relax in ("rotate", "both")
    return {"error_feedback": ef, "rotate": ROTATE_ROWS if rot else 0, "estimator": "zero" if ef else estimator}
ALGOS = ("ddp", "fsdp")  # (the experiment's third, diloco, has a worker of its own)
ALIGN_POLL = 0.0002  # s between a waiting rank's looks at the HostBarrier's directory


class HostBarrier:
    """A barrier among processes of one host, through files in a directory they share.

    The experiment's ranks stop together after an evaluation (rank 0 evaluates alone) and must
    start the next step together: the steps are timed, the pause is not.  A Gloo barrier does
    it over the testbed's links, which drop 10 % of every port's packets in the paper
    scenario: a lost segment of the barrier's TCP exchange costs a retransmission timeout
    (200 ms at least), and the ranks then leave it up to that far apart.  The first ones
    out wait in the next step's round, which counts as training time; a file barrier has no
    links to lose on, and every rank leaves within a look (``ALIGN_POLL``) of the last one's
    arrival.

    Args:
        path: the directory (it exists; whoever made it removes it).
        rank: this process's rank.
        world: ranks that take part.
    """

    def __init__(self, path: str, rank: int, world: int):
        self.path, self.rank, self.world = path, rank, world
        self.n = 0  # barriers passed

    def wait(self, timeout: float = 120.0) -> None:
        """Return when every rank has called this as often as this rank has.

        Raises:
            TimeoutError: a rank did not arrive within ``timeout`` seconds (it failed or hangs).
        """
        self.n += 1
        if self.n > 2:  # (every rank has passed barrier n - 2 once this rank passed n - 1: nobody looks for it)
            os.unlink(os.path.join(self.path, f"{self.n - 2}.{self.rank}"))
        with open(os.path.join(self.path, f"{self.n}.{self.rank}"), "x"):
            pass
        missing = [os.path.join(self.path, f"{self.n}.{r}") for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + timeout
        while missing:
            missing = [f for f in missing if not os.path.exists(f)]
            if missing:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: {len(missing)} of {self.world} ranks did not reach "
                                       f"barrier {self.n} in {self.path} within {timeout:.0f} s")
                time.sleep(ALIGN_POLL)


class TrainingClock:
    """The run's training time and CPU: from :meth:`start`, less every :meth:`pause`
    (evaluations, divergence and gradient checks), each ended by the ranks lining up.

    Args:
        align: the barrier that lines the ranks up (:meth:`HostBarrier.wait`, or
            ``dist.barrier``): the steps after a pause start together.
    """

    def __init__(self, align):
        self.align = align
        self.t0 = self.cpu0 = self.paused = self.cpu_paused = 0.0

    def start(self) -> None:
        self.align()
        self.t0, self.cpu0 = time.monotonic(), cpu_s()

    def elapsed(self, now: float | None = None) -> float:
        """Training seconds at ``now`` (monotonic; default: now)."""
        return (time.monotonic() if now is None else now) - self.t0 - self.paused

    def cpu(self) -> float:
        """This process's CPU seconds over the training so far."""
        return cpu_s() - self.cpu0 - self.cpu_paused

    @contextlib.contextmanager
    def pause(self):
        """Leave what runs inside out of the training time and CPU; the ranks line up at its end."""
        t, c = time.monotonic(), cpu_s()
        yield
        self.align()
        self.paused += time.monotonic() - t
        self.cpu_paused += cpu_s() - c


def cpu_s() -> float:
    """Seconds of CPU this process used so far, user and system, every thread (the transport's
    and the collective's included; softirq work the kernel charges elsewhere is not)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def tcp_retransmits() -> int:
    """TCP segments retransmitted in this network namespace (RetransSegs)."""
    lines = open("/proc/self/net/snmp").read().splitlines()
    head, vals = [l.split() for l in lines if l.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


CONSISTENCY_USE = ("allgather, allgather:bound, allgather:carry, sharded, sharded:whole, none or broadcast:N "
                   "(N >= 1 steps)")


def consistency(spec: str) -> tuple[dict, int, bool]:
    """The Config knobs, the ParameterBroadcaster interval (0: none) and whether the optimizer is
    sharded, of a ``--consistency``: ``allgather`` (identical results, the all-gather repaired
    whole; the default) -> ``({"consistent": True}, 0, False)``; ``allgather:bound`` (identical
    results, the all-gather stops at the round's bound, the rest filled from the last result) and
    ``allgather:carry`` (the same, the rest applied a round later: ``fill="carry"``); ``sharded``
    (a sharded optimizer, ``pydblp.torch.ShardedSGD``/``ShardedAdam``: the all-gather carries
    parameters and tolerates loss, a row not delivered keeps its value) and ``sharded:whole``
    (the same, the all-gather repaired whole: identical replicas); ``none`` (the all-gather
    tolerates loss); ``broadcast:N`` (none, plus a parameter broadcast every N steps).
    ValueError otherwise."""
    if spec == "allgather":
        return {"consistent": True}, 0, False
    if spec in ("allgather:bound", "allgather:carry"):
        return ({"consistent": True, "allgather_bound": True, "fill": "carry" if spec.endswith("carry") else "stale"},
                0, False)
    if spec in ("sharded", "sharded:whole"):
        return {"consistent": spec == "sharded:whole"}, 0, True
    if spec == "none":
        return {"consistent": False}, 0, False
    name, _, n = spec.partition(":")
    if name == "broadcast" and n.isdigit() and int(n) >= 1:
        return {"consistent": False}, int(n), False
    raise ValueError(f"consistency {spec!r}: use {CONSISTENCY_USE}")


@torch.no_grad()
def divergence(model: torch.nn.Module) -> tuple[float, float]:
    """(max |p - p0|, max ||p - p0|| / ||p0||) over all ranks, p0 rank 0's parameters (Gloo collectives)."""
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    diff = flat - ref
    out = torch.tensor([diff.abs().max().item(), (diff.norm() / ref.norm().clamp_min(1e-30)).item()])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out[0]), float(out[1])


def shard_model(model: torch.nn.Module, group) -> None:
    """FSDP2 over ``group`` (None: the default group): each child module holding parameters is
    sharded on its own (its all-gather and reduce-scatter are its own rounds), then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = None if group is None else DeviceMesh.from_group(group, "cpu")
    for m in list(model.modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def no_sync(ddp, model):
    """A context without gradient synchronisation: DDP's ``no_sync``, or FSDP2's switch."""
    import contextlib

    if ddp is not None:
        return ddp.no_sync()

    @contextlib.contextmanager
    def off():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return off()


def local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values on this rank (an FSDP parameter's local shard)."""
    p = p.detach()
    return p.to_local() if hasattr(p, "to_local") else p


def phase_report(controller) -> dict:
    """Every rank's phase decisions, gathered over Gloo: rank 0's series, each rank's hash, agreement."""
    hist = [[int(i), float(g), bool(c)] for i, g, c in getattr(controller, "history", [])]
    decisions = [[i, c] for i, _, c in hist]
    digest = hashlib.sha256(json.dumps(decisions).encode()).hexdigest()[:16]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"hash": digest, "history": hist})
    g0 = [h[1] for h in everyone[0]["history"]]
    g_diff = max((abs(h[1] - g) / max(abs(g), 1e-30) for e in everyone for h, g in zip(e["history"], g0)),
                 default=0.0)
    return {"history": everyone[0]["history"], "hashes": [e["hash"] for e in everyone],
            "identical": len({e["hash"] for e in everyone}) == 1, "g_max_rel_diff": g_diff,
            "histories": [e["history"] for e in everyone]}


def main(argv=None) -> int:
    a = parse(argv)
    knobs, every, sharded = consistency(a.consistency)
    sharded = sharded and a.arm != "gloo"
    fsdp = a.algo == "fsdp"
    backend = (fsdp or a.via == "backend") and a.arm != "gloo"  # pydblp as a torch.distributed group
    if a.via == "backend" and (sharded or every or a.priority == "layer"):
        raise SystemExit("--via backend: the hook's extras (--consistency sharded/broadcast:N, --priority layer) "
                         "need --via hook")
    if fsdp and (sharded or every):
        raise SystemExit(f"--algo fsdp shards the model itself: use --consistency allgather or none, "
                         f"not {a.consistency}")
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    state = None
    rounds: list[dict] = []  # every round's record, compact (Config.on_record)
    try:
        digits = a.model in models.DIGITS_MODELS
        if digits:
            xtr, ytr, xte, yte = data.digits(seed=a.seed, test_fraction=HELDOUT_FRACTION)
            mine = data.shard(len(xtr), a.rank, a.world, a.seed)
            lr = a.lr or 0.05
            model = models.make(a.model)
        else:
            tr, te, vocab = data.text()
            model = models.make(a.model, vocab)
            xte, yte = models.heldout(te, model.context)
            lr = a.lr or 3e-3
        samples = a.batch or models.BATCH.get(a.model, 32)  # per rank and step
        ddp = DDP(model) if not fsdp and not backend else None
        broadcaster = None
        if fsdp and a.arm == "gloo":
            shard_model(model, None)
        if a.arm != "gloo":
            import pydblp.torch as ptorch
            from pydblp.collective import Config, Dblp, Static

            phase = Static(a.p_low) if a.arm == "static" else Dblp(a.p_low, k=a.k, freq=a.freq, eta=a.eta,
                                                                           g_over=a.g_over, high=a.high)
            cfg = Config(job=11, phase=phase, **knobs, **relax_knobs(a.relax, a.estimator), order=a.order,
                         stagger=a.stagger == "on", spread=a.spread,
                         peer_timeout=a.peer_timeout, mode=a.mode, cc=a.cc, plan=a.plan,
                         allgather=a.allgather, priority=a.priority, on_record=None if not a.round_records else
                         lambda r: rounds.append(
                             {"tol": r.tol, "phase": r.phase, "latency": r.latency, "delivered": r.min_delivered,
                              "retx": r.retransmits, "below": r.below_bound, "tensor": r.tensor,
                              "ce": r.ce_received, "paced": r.paced}))
            group = tuple(json.loads(a.group)) if a.allgather == "broadcast" else None
            if backend:  # the bounded-loss collective as a torch.distributed group: DDP or FSDP2 over it
                # FSDP2 with --consistency none: its parameter all-gather tolerates the bound too
                pg = dist.new_group(backend="dblp", pg_options=ptorch.BackendOptions(
                    transport=a.net, iface=a.iface, port=a.port, config=cfg, rate=a.rate,
                    allgather="tolerant" if fsdp and not cfg.consistent else "exact"))
                if fsdp:
                    shard_model(model, pg)
                else:
                    ddp = DDP(model, process_group=pg)
                state = pg.state
            else:
                state = ptorch.State.from_process_group(a.net, iface=a.iface, port=a.port, config=cfg, rate=a.rate,
                                                        group=group)
            if state.data_plane is not None:  # this rank's first log line: its queues, copy or zero-copy mode
                print(f"rank {a.rank}: data plane {state.data_plane.describe()}", file=sys.stderr, flush=True)
            if a.priority == "layer":
                state.register_model(model)
            if not sharded and not backend:
                ddp.register_comm_hook(state, ptorch.hook)
            if every:
                broadcaster = ptorch.ParameterBroadcaster(state, model, every=every)
            if a.warm_up and not backend:  # (over the backend DDP's initial broadcast has used the data path)
                state.warm_up(ddp if ddp is not None else model, a.warm_up)  # (DDP: its bucket cap)
        if sharded:  # the same rules, each rank stepping the shard it owns (no DDP synchronisation)
            opt = (ptorch.ShardedSGD(state, model, lr=lr, momentum=0.9) if digits
                   else ptorch.ShardedAdam(state, model, lr=lr))
        else:
            opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) if digits
                   else torch.optim.Adam(model.parameters(), lr=lr))
        gen = torch.Generator().manual_seed(a.seed * 1000 + a.rank)

        def draw():
            if digits:
                idx = mine[torch.randint(0, len(mine), (samples,), generator=gen)]
                return xtr[idx], ytr[idx]
            return models.text_batch(tr, samples, model.context, gen)

        net = model if sharded or fsdp else ddp  # (a sharded optimizer synchronises; DDP's reducer must not)

        def loss_of(batch):
            x, y = batch
            if digits:
                return torch.nn.functional.cross_entropy(net(x), y)
            return torch.nn.functional.cross_entropy(net(x).reshape(-1, vocab), y.reshape(-1))

        def batch_loss():
            return loss_of(draw())

        params = [p for p in model.parameters() if p.requires_grad]

        def exact_mean(batch) -> torch.Tensor:
            """The step's exact mean gradient: this rank's own (DDP's no_sync), allreduced over Gloo."""
            opt.zero_grad()  # (the last step's gradients are still there: no_sync would add to them)
            with ddp.no_sync():
                loss_of(batch).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            opt.zero_grad()
            dist.all_reduce(flat)
            return flat / a.world

        # the step's compute alone: forward + backward without synchronisation (nothing is applied)
        calib = []
        for _ in range(6):
            t0 = time.monotonic()
            with no_sync(ddp, model):
                batch_loss().backward()
            calib.append(time.monotonic() - t0)
            opt.zero_grad()
        emit({"calibrate": sorted(calib[1:])[len(calib[1:]) // 2]})
        eval_at = set(a.eval_at)
        retrans0 = tcp_retransmits()
        clock = TrainingClock(HostBarrier(a.align, a.rank, a.world).wait if a.align else dist.barrier)
        clock.start()
        for step in range(a.steps):
            batch, exact = draw(), None
            # (a sharded optimizer's averaged gradient exists only in pieces, at the shards' owners;
            # a ring allreduce lets ranks go tens of ms apart: the pause lines them up again)
            if state is not None and a.grad_error_every and not sharded and not fsdp and step % a.grad_error_every == 0:
                with clock.pause():
                    exact = exact_mean(batch)
            ts = time.monotonic()
            loss = loss_of(batch)
            opt.zero_grad()
            t0 = time.monotonic()  # CLOCK_MONOTONIC: the fabric's burst clock too
            loss.backward()
            if sharded:  # the round: reduce-scatter, each owner's step, all-gather of the parameters
                opt.step()
            t1 = time.monotonic()
            if exact is not None and a.rank == 0:  # what loss and shedding did to the averaged gradient
                got = torch.cat([p.grad.reshape(-1) for p in params])
                emit({"gerr": float((got - exact).norm() / exact.norm().clamp_min(1e-30)), "step": step})
            if not sharded:
                opt.step()
            t2 = time.monotonic()
            if broadcaster is not None:
                broadcaster.step()
            t3 = time.monotonic()
            emit({"step": step, "t": clock.elapsed(t3), "t0": t0, "loss": loss.item(), "sync": t1 - t0,
                  "dt": t3 - ts, "opt": t2 - t1})
            if step % a.eval_every == a.eval_every - 1 or step == a.steps - 1 or step + 1 in eval_at:
                with clock.pause():  # (rank 0 evaluates alone: the next step starts with the ranks lined up)
                    t_eval = clock.elapsed()
                    if a.rank == 0 or fsdp:  # (FSDP: every rank's forward gathers the parameters)
                        model.eval()
                        q = models.evaluate(model, xte, yte)
                        model.train()
                        if a.rank == 0:
                            name = "accuracy" if digits else "perplexity"
                            emit({"eval": q[name], "metric": name, "loss": q["loss"], "step": step, "t": t_eval})
                    div, div_rel = divergence(model) if not fsdp else (0.0, 0.0)  # (FSDP: one copy, sharded)
                    if a.rank == 0:
                        emit({"div": div, "div_rel": div_rel, "step": step})
        wall, cpu = clock.elapsed(), [None] * a.world  # (read before the gather: a collective over the links)
        dist.all_gather_object(cpu, clock.cpu())  # every rank's process CPU over the training steps
        final = {"final": True, "wall": wall, "cpu": cpu,
                 "tcp_retransmits": tcp_retransmits() - retrans0,
                 # this rank's parameters, bit for bit: two runs that must be identical compare it
                 "params_sha256": hashlib.sha256(b"".join(local(p).numpy().tobytes()
                                                          for p in model.parameters())).hexdigest()}
        if state is not None:
            final["rounds"] = rounds  # every round's (Collective.records keeps only the latest)
            final["chunk_bytes"] = state.collective.cfg.chunk_bytes
            # an all-gather's repairs after its round returned (a server's, mostly) are in no record
            final["trail_retransmits"] = state.collective.counters["trail_retransmits"]
            final["phase"] = phase_report(state.collective.controller)
            host = [None] * a.world  # every rank's host-program counters (sheds by priority)
            dist.all_gather_object(host, state.host_counters())
            final["host"] = host
            # every rank's transport counters (rx_invalid, auth_*, ...) and the collective's drops
            ctr = [None] * a.world
            dist.all_gather_object(ctr, {"transport": state.collective.t.stats(),
                                         "collective": dict(state.collective.counters)})
            final["counters"] = ctr
        if a.rank == 0:
            emit(final)
        return 0
    finally:
        if state is not None and not backend:  # (a group's state is closed with the group)
            state.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
