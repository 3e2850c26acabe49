"""Train the digits CNN with DDP, gradients averaged by pydblp's bounded-loss collective.

A plain ``torchrun`` script for your own cluster (one process per host)::

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank K \\
        --master-addr HOST0 --master-port 29500 \\
        examples/train_ddp.py --iface eth0 [--transport udp|xsk] [--phase dblp|static:0.02]

or on one host, for a try (in-host ranks need distinct data-plane ports:
``--port 0`` picks free ones)::

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --port 0

What it does: ``init_process_group("gloo")`` (the control plane: rendezvous,
and this script's once-per-epoch metrics; on ``--iface`` unless
``GLOO_SOCKET_IFNAME`` names another NIC), opens the data plane on
``--iface`` and registers :func:`pydblp.torch.hook` on a DDP model, so every
gradient bucket goes through the collective.  With ``--broadcast-every K``
a :class:`pydblp.torch.ParameterBroadcaster` re-broadcasts parameters every
K steps (bounded drift under loss).  Rank 0 prints, per epoch: mean train
loss and accuracy over all ranks, test accuracy, the spread of parameters
across ranks (max |p_i - p_j|; non-zero only when loss made ranks disagree)
and its collective's round stats (latency p50/p99/max, tolerance, delivered
fraction, retransmits, rounds ended below their bound).

Failure semantics: loss never raises (within a round's tolerance it is
absorbed, above it repaired); a peer silent for ``--peer-timeout`` seconds
makes ``backward()`` raise ``CollectiveError`` and the script exits 1.
The state is closed in ``finally`` either way.

``--transport xsk`` (AF_XDP) needs root (CAP_NET_ADMIN, CAP_BPF) and
attaches the host XDP program to ``--iface`` unless ``dblp load`` did;
``udp`` works as any user.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pydblp.torch as ptorch
from pydblp.cliutil import Parser
from pydblp.collective import CollectiveError, Config, phase as phases
from pydblp.collective.config import CHUNK_MAX, TIMEOUT_MAX
from pydblp.experiment import data, models


def parse(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # (a mistake: one line)
    p.add_argument("--iface", help="data-plane NIC (default: none, loopback 127.0.0.1; fine for one host)")
    p.add_argument("--addr", help="address published to peers (default: the first IPv4 address of --iface)")
    p.add_argument("--transport", choices=["udp", "xsk"], default="udp", help="xsk = AF_XDP (root)")
    p.add_argument("--port", type=int, default=47800, help="data-plane UDP port; 0 = any free one "
                                                           "(needed for several ranks on one host)")
    p.add_argument("--queue", type=int, default=None, help="one NIC queue (xsk; default: every receive queue)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="xsk: pace transmission at this line rate, bits/s (e.g. 1e9 in the testbed, whose "
                        "TBF AF_XDP bypasses; default 0: unpaced)")
    p.add_argument("--phase", default="dblp", help="dblp, dblp:P_LOW or static:TOL (default dblp)")
    p.add_argument("--estimator", choices=["unbiased", "zero"], default="unbiased")
    p.add_argument("--job", type=int, default=1, help="job id, the same on every rank")
    p.add_argument("--key-file", help="job key file, a copy on every rank (default: $DBLP_KEY_FILE or "
                                      "$DBLP_KEY, else none): every packet tagged and verified")
    p.add_argument("--chunk-bytes", default="1408", metavar="B|link",
                   help="gradient bytes per packet, the same on every rank, or 'link': the largest the NICs' "
                        "MTU carries, agreed at start-up (8000 on jumbo frames; default 1408, for MTU 1500)")
    p.add_argument("--peer-timeout", type=float, default=30.0, help="seconds of silence that fail a round")
    p.add_argument("--broadcast-every", type=int, default=0, metavar="K",
                   help="re-broadcast parameters every K steps (0: never)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps in all (0: no limit)")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-gloo", action="store_true",
                   help="also average every gradient bucket with Gloo's allreduce and exit 1 if pydblp's mean "
                        "differs by more than 1e-5 (a check for a loss-free network)")
    a = p.parse_args(argv)
    # every mistake refused here, before the rendezvous (which waits for the other ranks)
    chunk = a.chunk_bytes if a.chunk_bytes == "link" else int(a.chunk_bytes) if a.chunk_bytes.isdigit() else -1
    for bad, what in ((not 0 <= a.port <= 65535, f"--port {a.port}: use 1..65535, or 0 for any free one"),
                      (a.queue is not None and a.queue < 0, f"--queue {a.queue}: use a NIC queue, 0 or more"),
                      (not 0 <= a.rate < math.inf, f"--rate {a.rate:g}: use bits/s >= 0 (0: unpaced), e.g. 1e9"),
                      (not 1 <= a.job <= 0xFFFFFFFF, f"--job {a.job}: use 1..{0xFFFFFFFF}"),
                      (chunk != "link" and (chunk % 4 or not 64 <= chunk <= CHUNK_MAX),
                       f"--chunk-bytes {a.chunk_bytes}: use a multiple of 4 in 64..{CHUNK_MAX}, or link, "
                       f"e.g. --chunk-bytes 1408"),
                      (not 0 < a.peer_timeout <= TIMEOUT_MAX,
                       f"--peer-timeout {a.peer_timeout:g}: use seconds in (0, {TIMEOUT_MAX:g}], e.g. 30"),
                      (a.broadcast_every < 0, f"--broadcast-every {a.broadcast_every}: use 0 (never) or more steps"),
                      (a.epochs < 1, f"--epochs {a.epochs}: use 1 or more"),
                      (a.steps < 0, f"--steps {a.steps}: use 0 (no limit) or more"),
                      (a.batch < 1, f"--batch {a.batch}: use 1 or more samples"),
                      (not 0 < a.lr < math.inf, f"--lr {a.lr:g}: use a learning rate above 0, e.g. 0.05")):
        if bad:
            p.error(what)
    try:
        phases.make(a.phase)
    except ValueError as e:
        p.error(f"--phase {a.phase}: {e}; e.g. --phase dblp or --phase static:0.02")
    if a.iface:
        try:
            socket.if_nametoindex(a.iface)
        except OSError:
            p.error(f"--iface {a.iface}: no such interface here (ip link lists them)")
    if a.key_file:
        try:
            open(a.key_file, "rb").close()
        except OSError as e:
            p.error(f"--key-file {a.key_file}: {e.strerror}")
    return a


def log(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def param_spread(module: torch.nn.Module) -> float:
    """max |p_i - p_j| over ranks and parameters (two small Gloo allreduces)."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).max())


def gloo_checked(hook, diffs: list[float]):
    """A comm hook that runs ``hook`` and records, per bucket, max |its mean - Gloo's mean| in ``diffs``.

    Gloo's allreduce of the same bucket runs first, on this thread (every rank's DDP calls the hook
    for the same buckets in the same order); the comparison runs when ``hook``'s future completes.
    """
    def checked(state, bucket):
        ref = bucket.buffer().detach().clone()
        dist.all_reduce(ref)
        ref /= dist.get_world_size()

        def compare(fut):
            got = fut.value()
            diffs.append(float((got - ref).abs().max()))
            return got

        return hook(state, bucket).then(compare)

    return checked


def round_stats(recs) -> str:
    if not recs:
        return "no rounds"
    lat = np.array([r.latency for r in recs]) * 1e3
    return (f"{len(recs)} rounds, latency p50 {np.median(lat):.1f} p99 {np.percentile(lat, 99):.1f} "
            f"max {lat.max():.1f} ms, tol {np.mean([r.tol for r in recs]) * 100:.1f} % mean, "
            f"delivered min {min(r.min_delivered for r in recs):.3f}, "
            f"retransmits {sum(r.retransmits for r in recs)}, below bound {sum(r.below_bound for r in recs)}")


def main(argv=None) -> int:
    a = parse(argv)
    torch.manual_seed(a.seed)  # same initial model on every rank (DDP also broadcasts it)
    if a.iface:  # Gloo binds what the hostname resolves to (loopback in the testbed) unless told
        os.environ.setdefault("GLOO_SOCKET_IFNAME", a.iface)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(60.0, 2 * a.peer_timeout)))
    rank, world = dist.get_rank(), dist.get_world_size()
    state = None
    try:
        chunk = None if a.chunk_bytes == "link" else int(a.chunk_bytes)
        cfg = Config(job=a.job, phase=a.phase, estimator=a.estimator, peer_timeout=a.peer_timeout,
                     chunk_bytes=chunk)
        state = ptorch.State.from_process_group(a.transport, iface=a.iface, port=a.port, queue=a.queue,
                                                addr=a.addr, config=cfg, rate=a.rate, key_file=a.key_file)
        col = state.collective
        mode = (f" ({'zero-copy' if getattr(col.t, 'zerocopy', False) else 'copy'} mode, queues "
                f"{','.join(map(str, getattr(col.t, 'queues', [a.queue])))})" if a.transport == "xsk" else "")
        log(f"world {world}, {a.transport}{mode} on {a.iface or 'loopback'}, port {col.t.port} (rank 0), "
            f"phase {a.phase}, estimator {a.estimator}, {col.cfg.chunk_bytes}-byte chunks, "
            f"broadcast every {a.broadcast_every or 'never'}")

        model = models.DigitsCNN()
        ddp = DDP(model)
        diffs: list[float] = []
        ddp.register_comm_hook(state, gloo_checked(ptorch.hook, diffs) if a.check_gloo else ptorch.hook)
        state.warm_up(ddp)  # (DDP broadcast the parameters over Gloo: the data path's first rounds come now)
        bc = ptorch.ParameterBroadcaster(state, model, a.broadcast_every) if a.broadcast_every else None
        opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=0.9)

        xtr, ytr, xte, yte = data.digits(seed=a.seed)
        mine = data.shard(len(xtr), rank, world, a.seed)
        per_epoch = max(1, (len(xtr) // world) // a.batch)  # equal on every rank: DDP needs lockstep
        gen = torch.Generator().manual_seed(a.seed * 1000 + rank)
        step, t_start = 0, time.monotonic()
        for epoch in range(a.epochs):
            i_rec, t0 = col.index, time.monotonic()
            order = mine[torch.randperm(len(mine), generator=gen)]
            tot = torch.zeros(3)  # loss sum, correct, samples
            for i in range(per_epoch):
                if a.steps and step >= a.steps:
                    break
                idx = order[(i * a.batch) % len(order):][: a.batch]
                out = ddp(xtr[idx])
                loss = torch.nn.functional.cross_entropy(out, ytr[idx])
                opt.zero_grad()
                loss.backward()  # gradients averaged through pydblp here
                opt.step()
                if bc is not None:
                    bc.step()
                step += 1
                tot += torch.tensor([loss.item() * len(idx), (out.argmax(1) == ytr[idx]).sum().item(), len(idx)])
            dist.all_reduce(tot)  # metrics only, over the Gloo control plane
            model.eval()
            acc = models.accuracy(model, xte, yte)
            model.train()
            spread = param_spread(model)
            log(f"epoch {epoch + 1}/{a.epochs}  steps {step}  loss {tot[0] / max(tot[2], 1):.4f}  "
                f"train acc {tot[1] / max(tot[2], 1):.3f}  test acc {acc:.3f}  param spread {spread:.2e}  "
                f"{time.monotonic() - t0:.1f} s")
            log(f"  rank 0 collective: {round_stats([r for r in col.records if r.index >= i_rec])}")
            if a.steps and step >= a.steps:
                break
        log(f"done: {step} steps in {time.monotonic() - t_start:.1f} s; "
            f"latest rounds (Config.records_max): {round_stats(col.records)}; counters {col.counters}")
        dist.barrier()  # nobody stops answering late probes before every rank has finished
        if a.check_gloo:
            worst = max(diffs, default=float("nan"))
            print(f"rank {rank}: {len(diffs)} buckets checked against Gloo, max |difference| {worst:.3g}",
                  flush=True)
            if not diffs or not worst <= 1e-5:
                return 1
        return 0
    except (CollectiveError, RuntimeError) as e:  # DDP may re-raise the hook's error as RuntimeError
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if state is not None:
            state.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny model: threads only contend with the transport
    sys.exit(main())
