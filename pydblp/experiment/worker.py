"""One rank of the experiment: train with DDP over Gloo or pydblp, report JSON lines.

Run by :mod:`pydblp.experiment.runner` inside a testbed worker namespace (and
usable by hand under ``torchrun``: it reads RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT when the flags are absent).  Every line on stdout is one JSON
object: ``{"step", "t", "loss", "sync"}`` per step (``sync``: seconds of
backward + gradient synchronisation), ``{"eval", ...}`` every
``--eval-every`` steps, and a final ``{"final", ...}`` with the collective's
round records.  Failures go to stderr and the exit status.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pydblp.experiment import data, models


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--master", default=f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:"
                                       f"{os.environ.get('MASTER_PORT', '29500')}")
    p.add_argument("--transport", choices=["gloo", "static", "dblp"], default="dblp")
    p.add_argument("--net", choices=["udp", "xsk", "xsk-ktx"], default="udp", help="pydblp data plane")
    p.add_argument("--iface", help="data-plane interface (pydblp)")
    p.add_argument("--port", type=int, default=47800, help="data-plane UDP port (0: any free one)")
    p.add_argument("--model", choices=["digits", "text"], default="digits")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=0.016, help="static tolerance; dblp's P_low")
    p.add_argument("--estimator", choices=["zero", "unbiased"], default="unbiased")
    p.add_argument("--mode", choices=["tar", "ps"], default="tar", help="pydblp Config.mode")
    p.add_argument("--allgather", choices=["unicast", "broadcast"], default="unicast", help="pydblp Config.allgather")
    p.add_argument("--group", help="JSON [address, port, mac] every rank receives (--allgather broadcast)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--peer-timeout", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=0.0,
                   help="the link's bits/s: the xsk transport paces at it (AF_XDP bypasses the TBF)")
    return p.parse_args(argv)


def tcp_retransmits() -> int:
    """TCP segments retransmitted in this network namespace (RetransSegs)."""
    lines = open("/proc/self/net/snmp").read().splitlines()
    head, vals = [l.split() for l in lines if l.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    a = parse(argv)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    state = None
    rounds: list[dict] = []  # every round's record, compact (Config.on_record)
    try:
        if a.model == "digits":
            model = models.DigitsCNN()
            xtr, ytr, xte, yte = data.digits(seed=a.seed)
            mine = data.shard(len(xtr), a.rank, a.world, a.seed)
            lr = a.lr or 0.05
        else:
            tr, te, vocab = data.text()
            model = models.CharTransformer(vocab)
            lr = a.lr or 3e-3
        ddp = DDP(model)
        if a.transport != "gloo":
            import pydblp.torch as ptorch
            from pydblp.collective import Config, Dblp, Static

            phase = Static(a.tol) if a.transport == "static" else Dblp(p_low=a.tol)
            cfg = Config(job=11, phase=phase, estimator=a.estimator, peer_timeout=a.peer_timeout, mode=a.mode,
                         allgather=a.allgather, on_record=lambda r: rounds.append(
                             {"tol": r.tol, "phase": r.phase, "latency": r.latency, "delivered": r.min_delivered,
                              "retx": r.retransmits, "below": r.below_bound}))
            group = tuple(json.loads(a.group)) if a.allgather == "broadcast" else None
            state = ptorch.State.from_process_group(a.net, iface=a.iface, port=a.port, config=cfg, rate=a.rate,
                                                    group=group)
            ddp.register_comm_hook(state, ptorch.hook)
        opt = (torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9) if a.model == "digits"
               else torch.optim.Adam(ddp.parameters(), lr=lr))
        gen = torch.Generator().manual_seed(a.seed * 1000 + a.rank)
        retrans0 = tcp_retransmits()
        t_start = time.monotonic()
        for step in range(a.steps):
            if a.model == "digits":
                idx = mine[torch.randint(0, len(mine), (a.batch,), generator=gen)]
                out = ddp(xtr[idx])
                loss = torch.nn.functional.cross_entropy(out, ytr[idx])
            else:
                x, y = models.text_batch(tr, a.batch, model.context, gen)
                loss = torch.nn.functional.cross_entropy(ddp(x).reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad()
            t0 = time.monotonic()  # CLOCK_MONOTONIC: the fabric's burst clock too
            loss.backward()
            t1 = time.monotonic()
            opt.step()
            emit({"step": step, "t": t1 - t_start, "t0": t0, "loss": loss.item(), "sync": t1 - t0})
            if a.rank == 0 and (step % a.eval_every == a.eval_every - 1 or step == a.steps - 1):
                ddp.eval()
                metric = (models.accuracy(model, xte, yte) if a.model == "digits"
                          else models.perplexity(model, te, model.context))
                ddp.train()
                emit({"eval": metric, "metric": "accuracy" if a.model == "digits" else "perplexity",
                      "step": step, "t": time.monotonic() - t_start})
        final = {"final": True, "wall": time.monotonic() - t_start, "tcp_retransmits": tcp_retransmits() - retrans0}
        if state is not None:
            final["rounds"] = rounds  # every round's (Collective.records keeps only the latest)
            # an all-gather's repairs after its round returned (a server's, mostly) are in no record
            final["trail_retransmits"] = state.collective.counters["trail_retransmits"]
        emit(final)
        return 0
    finally:
        if state is not None:
            state.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
