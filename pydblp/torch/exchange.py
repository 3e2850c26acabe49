"""How DiLoCo workers exchange tensors: an exact mean, or a neighbour average that skips the silent.

:class:`Exchange` is what :class:`~pydblp.torch.DiLoCo` calls; it has two
implementations:

* :class:`GlooExchange`: the exact mean is torch.distributed's ``all_reduce``
  on a Gloo group; neighbour averages go through per-rank mailboxes, a
  torch.distributed ``TCPStore`` server in every rank (its address published
  in the default store), to which neighbours push their tensors.  A Gloo
  point-to-point receive cannot serve here: a Gloo ``wait(timeout)`` that
  expires closes the connection to that peer for good, so a slow peer could
  never be re-admitted.  A mailbox wait that expires costs nothing.
* :class:`PydblpExchange`: the exact mean and the neighbour average through
  pydblp's bounded-loss collective (:class:`~pydblp.torch.State`):
  ``Collective.allreduce`` and ``Collective.neighbours`` (a neighbour round:
  loss within the round's tolerance absorbed, above it repaired; a neighbour
  below its bound at its deadline left out of that round, and taken in again
  as soon as its messages arrive in time).

Failure semantics of a neighbour average (Gloo; pydblp's in
:meth:`pydblp.collective.Collective.neighbours`): each neighbour has ``timeout``
seconds, from the start of the call, to deliver this round's tensor; one that
does not is left out of this round's average (the weights of those that
arrived are renormalised) and becomes *suspect*: later rounds take its tensor
only if it is already there, except every ``readmit_every``-th round, which
waits for it the full timeout again; so a dead peer costs one timeout per
``readmit_every`` rounds, and a live one that fell behind (stalled past the
timeout) is waited for again, each such wait closing up to ``timeout`` of its
lag.  A suspect whose tensor arrives in time is re-admitted (no longer
suspect).  Tensors that arrive after their round was
given up are deleted unread.  ``allreduce_mean`` is exact or it raises: over
Gloo a dead peer fails it (``RuntimeError`` after the group's timeout), over
pydblp as :class:`~pydblp.collective.CollectiveError` after ``peer_timeout``.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import queue
import random
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from pydblp.collective.config import TENSOR_DILOCO

log = logging.getLogger(__name__)

TOPOLOGIES = ("ring", "exp", "random")

__all__ = ["Exchange", "GlooExchange", "PydblpExchange", "TOPOLOGIES", "neighbours"]


def neighbours(topology: str, rank: int, world: int, round: int, seed: int = 0) -> list[int]:
    """This rank's neighbours in mixing round ``round``: the same answer on every rank.

    Args:
        topology: ``ring`` (rank +- 1), ``exp`` (rank +- 2^k for 2^k < world: an
            exponential graph, undirected; complete up to world 4) or ``random``
            (a seeded random perfect matching each round: one peer, or none for
            the odd rank out).
        rank, world: this rank and the number of ranks.
        round: the mixing round (``random`` draws a new matching per round).
        seed: the matching's seed; every rank must pass the same one.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology {topology!r}: use {', '.join(TOPOLOGIES)}")
    if world < 2:
        return []
    if topology == "random":
        order = list(range(world))
        random.Random(seed * 1_000_003 + round).shuffle(order)
        i = order.index(rank)
        mate = i + 1 if i % 2 == 0 else i - 1
        return [order[mate]] if mate < world else []
    steps = [1] if topology == "ring" else [1 << k for k in range(world.bit_length()) if (1 << k) < world]
    out = []
    for s in steps:
        for r in ((rank + s) % world, (rank - s) % world):
            if r != rank and r not in out:
                out.append(r)
    return sorted(out)


class Exchange:
    """What DiLoCo needs from the network.

    ``bytes_sent`` counts the payload bytes this rank has handed to the
    network (tensor bytes, no protocol headers).  An exchange with neighbour
    averages keeps ``suspects``: peer -> rounds since it was last waited for.
    """

    rank: int
    world: int
    bytes_sent: int = 0
    supports_neighbours: bool = False
    suspects: dict[int, int]

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The exact mean of ``tensor`` over all ranks (a new tensor); raises if a rank is gone."""
        raise NotImplementedError

    def neighbours_average(self, tensor: torch.Tensor, peers: list[int], weights: list[float],
                           round: int) -> tuple[torch.Tensor, list[int]]:
        """Send ``tensor`` to ``peers``, average what they sent back; ``(average, arrived ranks)``.

        Args:
            tensor: this rank's value (float32, same size on every rank).
            peers: the ranks to exchange with this round (each lists this rank too).
            weights: one per peer; this rank's own weight is ``1 - sum(weights)``.
                The result is ``(w_self * x + sum_arrived w_j x_j) / (w_self + sum_arrived w_j)``.
            round: the mixing round; the same sequence on every rank (names the messages).
        """
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a resumed exchange needs to treat its neighbours as this one would: its suspects
        (a new dict; empty for an exchange without neighbour averages)."""
        return {"suspects": dict(self.suspects)} if self.supports_neighbours else {}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state`` (:meth:`state_dict` of this rank's exchange in an earlier run): a
        neighbour suspect then is suspect now, waited for in the same rounds (and re-admitted
        when its tensor arrives, as any suspect)."""
        if self.supports_neighbours:
            self.suspects = {int(p): int(n) for p, n in state["suspects"].items()}

    def close(self) -> None:
        """Release what the exchange opened."""


class GlooExchange(Exchange):
    """Exact mean over a Gloo group; neighbour averages through per-rank ``TCPStore`` mailboxes.

    Every rank must construct it at the same point (it reads the other ranks'
    mailbox addresses from the default store).

    Args:
        addr: the address peers reach this rank's mailbox at (default 127.0.0.1;
            in a testbed, the worker's data address).
        timeout: seconds a neighbour has to deliver a round's tensor.
        group: the Gloo group of the exchange (default: the default group): ``rank``, ``world``
            and the neighbours' ranks are this group's; every member constructs it.
        store: where mailbox addresses are published (default: the default store).
        tag: names this exchange's keys in ``store`` (several exchanges per job).
        readmit_every: a suspect neighbour is waited for once every this many rounds.
    """

    supports_neighbours = True
    LATE_KEEP = 64  # rounds given up on that are remembered per peer (their tensors deleted if they come)

    def __init__(self, addr: str = "127.0.0.1", timeout: float = 5.0, group=None, store=None, tag: str = "diloco",
                 readmit_every: int = 4):
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group('gloo') first")
        if not timeout > 0:
            raise ValueError(f"timeout {timeout}: use a positive number of seconds")
        if readmit_every < 1:
            raise ValueError(f"readmit_every {readmit_every}: use 1 or more rounds")
        self.readmit_every = readmit_every
        self.group, self.timeout = group, timeout
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        if dist.get_rank() not in members:
            raise ValueError(f"rank {dist.get_rank()} is not a member of the group {members}: construct the "
                             "exchange on its members only")
        self.rank, self.world = members.index(dist.get_rank()), len(members)
        self.bytes_sent = 0
        self.suspects: dict[int, int] = {}   # peer -> rounds since it was last waited for
        store = store or dist.distributed_c10d._get_default_store()
        self._box = dist.TCPStore(addr, 0, None, True, timeout=datetime.timedelta(seconds=timeout),
                                  wait_for_workers=False)
        store.set(f"pydblp/{tag}/{dist.get_rank()}", json.dumps([addr, self._box.port]))
        self._where = [json.loads(store.get(f"pydblp/{tag}/{g}")) for g in members]  # by this group's rank
        # peer -> the rounds whose tensor was given up on, oldest first (deleted when they turn up)
        self._late: dict[int, collections.deque] = {}
        self._out: dict[int, queue.Queue] = {}
        self._senders: list[threading.Thread] = []
        self._closed = False

    # ---- exact ---------------------------------------------------------
    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to("cpu", torch.float64 if tensor.dtype == torch.float64 else torch.float32).clone()
        dist.all_reduce(out, group=self.group)
        # a ring allreduce sends 2 (W-1)/W of the tensor from every rank
        self.bytes_sent += int(2 * (self.world - 1) / self.world * out.numel() * out.element_size())
        return out / self.world

    # ---- neighbours ----------------------------------------------------
    def neighbours_average(self, tensor, peers, weights, round):
        if len(peers) != len(weights):
            raise ValueError(f"{len(peers)} peers but {len(weights)} weights")
        x = tensor.detach().to("cpu", torch.float32).contiguous()
        payload = x.numpy().tobytes()
        for p in peers:
            self._sender(p).put((self._key(round, self.rank), payload))
            self.bytes_sent += len(payload)
        self._forget_late()
        t0 = time.monotonic()
        arrived, acc, wsum = [], x.clone() * (1.0 - sum(weights)), 1.0 - sum(weights)
        # the others first: a suspect's tensor that comes while they are waited for counts too
        for p, w in sorted(zip(peers, weights), key=lambda pw: pw[0] in self.suspects):
            key = self._key(round, p)
            probe = p not in self.suspects or self.suspects[p] + 1 >= self.readmit_every
            wait = max(0.0, self.timeout - (time.monotonic() - t0)) if probe else 0.0
            if self._take(key, wait):
                acc += torch.frombuffer(bytearray(self._box.get(key)), dtype=torch.float32) * w
                wsum += w
                arrived.append(p)
                self._box.delete_key(key)
                self._forget_before(p, round)
                if p in self.suspects:
                    log.info("rank %d: peer %d is back (round %d)", self.rank, p, round)
                    del self.suspects[p]
            else:
                late = self._late.setdefault(p, collections.deque())
                late.append(round)
                if len(late) > self.LATE_KEEP:  # silent that long: dead, its old rounds will not come
                    late.popleft()
                if p not in self.suspects:
                    log.warning("rank %d: peer %d silent for %.1f s in round %d: left out until it returns",
                                self.rank, p, self.timeout, round)
                self.suspects[p] = 0 if probe else self.suspects[p] + 1
        return (acc / wsum).to(tensor.dtype).view_as(tensor), arrived

    def _take(self, key: str, wait: float) -> bool:
        if self._box.check([key]):
            return True
        if wait <= 0:
            return False
        try:
            self._box.wait([key], datetime.timedelta(seconds=wait))
            return True
        except dist.DistStoreError:
            return False

    def _forget_late(self) -> None:
        """Delete the tensors that came after their round was given up.  A peer's tensors come in
        the order it sent them (one connection), so only each peer's oldest is looked for: one
        lookup per silent peer and round, however long it stays silent."""
        for p, late in self._late.items():
            while late and self._box.check([self._key(late[0], p)]):
                self._box.delete_key(self._key(late.popleft(), p))

    def _forget_before(self, peer: int, round: int) -> None:
        """``peer``'s tensor of ``round`` came: its earlier ones came before it or never will."""
        late = self._late.get(peer)
        while late and late[0] < round:
            key = self._key(late.popleft(), peer)
            if self._box.check([key]):
                self._box.delete_key(key)

    @staticmethod
    def _key(round: int, src: int) -> str:
        return f"{round}/{src}"

    def _sender(self, peer: int) -> queue.Queue:
        """Each peer's messages go out in order on a thread of their own: a slow peer holds up no other."""
        if peer not in self._out:
            q: queue.Queue = queue.Queue()
            t = threading.Thread(target=self._send_loop, args=(peer, q), name=f"diloco-send-{peer}", daemon=True)
            self._out[peer] = q
            self._senders.append(t)
            t.start()
        return self._out[peer]

    def _send_loop(self, peer: int, q: queue.Queue) -> None:
        addr, port = self._where[peer]
        client, down_since = None, None
        while True:
            item = q.get()
            if item is None:
                return
            key, payload = item
            if down_since is not None and time.monotonic() - down_since < self.timeout:
                continue  # reconnect at most once a timeout: a dead peer is not redialled every round
            try:
                if client is None:
                    client = dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=self.timeout))
                client.set(key, payload)
                down_since = None
            except (RuntimeError, dist.DistError) as e:
                if down_since is None:
                    log.warning("rank %d: cannot reach peer %d's mailbox (%s)", self.rank, peer, str(e).split("\n")[0])
                client, down_since = None, time.monotonic()

    def close(self) -> None:
        """Stop the sender threads once they have delivered what is queued, and close the mailbox.

        The last round's messages may still be queued when a rank closes (its own round ended
        as soon as its neighbours' arrived), and its neighbours wait for them: they go out
        first.  A peer found down is not redialled (its messages are dropped); a thread dialling
        a dead peer can take two connect attempts of ``timeout`` each (torch's TCPStore retries
        once), and close waits for that rather than leave a thread inside torch at interpreter
        exit (which aborts the process).
        """
        if self._closed:
            return
        self._closed = True
        for q in self._out.values():
            q.put(None)
        for t in self._senders:
            t.join(timeout=3 * self.timeout)
            if t.is_alive():
                log.warning("rank %d: %s still sending after %.0f s", self.rank, t.name, 3 * self.timeout)
        self._box = None


class PydblpExchange(Exchange):
    """Exact mean and neighbour average through pydblp's bounded-loss collective.

    Both run on the state's transport thread, in the order they are called; the collective
    numbers every round with one counter, so every rank must make the same calls in the
    same order (DiLoCo does).  A neighbour average waits for each neighbour up to ``timeout``
    (longer for one that may still be waiting out a dead peer of its own in the previous
    round: :meth:`~pydblp.collective.Collective.neighbours`), leaves out one below its bound
    then, and never raises for it.  One left out becomes *suspect*, as in
    :class:`GlooExchange`: later rounds take its message only if it is already there (or
    arrives at once), except every ``readmit_every``-th round, which waits the full timeout
    for it; so a dead neighbour costs one timeout per ``readmit_every`` rounds.  A suspect
    whose message arrives is re-admitted.

    Args:
        state: a :class:`~pydblp.torch.State` (its transport thread runs the rounds).
        tensor: the collective's tensor id for DiLoCo's rounds (apart from DDP buckets').
        timeout: seconds a neighbour has per round; below the collective's
            ``Config.peer_timeout`` (default: half of it).
        readmit_every: a suspect neighbour is waited for once every this many rounds.
    """

    supports_neighbours = True

    def __init__(self, state, tensor: int = TENSOR_DILOCO, timeout: float | None = None, readmit_every: int = 4):
        peer_timeout = state.collective.cfg.peer_timeout
        if timeout is not None and not 0 < timeout < peer_timeout:
            raise ValueError(f"timeout {timeout}: use seconds in (0, Config.peer_timeout = {peer_timeout})")
        if readmit_every < 1:
            raise ValueError(f"readmit_every {readmit_every}: use 1 or more rounds")
        self.state, self.tensor = state, tensor
        self.timeout = peer_timeout / 2 if timeout is None else timeout
        self.readmit_every = readmit_every
        self.rank, self.world = state.collective.rank, state.collective.world
        self.bytes_sent = 0
        self.suspects: dict[int, int] = {}   # peer -> rounds since it was last waited for

    def neighbours_average(self, tensor, peers, weights, round):
        if len(peers) != len(weights):
            raise ValueError(f"{len(peers)} peers but {len(weights)} weights")
        x = tensor.detach().to("cpu", torch.float32).reshape(-1).numpy()
        probe = {p: p not in self.suspects or self.suspects[p] + 1 >= self.readmit_every for p in peers}
        waits = [self.timeout if probe[p] else 0.0 for p in peers]

        def run(col, x=x):
            y, arrived = col.neighbours(x, list(peers), list(weights), tensor=self.tensor, timeout=waits)
            return y, arrived, col.records[-1].bytes_sent

        y, arrived, sent = self.state.submit(run).wait()
        self.bytes_sent += sent
        for p in peers:
            if p in arrived:
                if self.suspects.pop(p, None) is not None:
                    log.info("rank %d: peer %d is back (round %d)", self.rank, p, round)
            else:
                if p not in self.suspects:
                    log.warning("rank %d: peer %d below its bound for %.1f s in round %d: left out until it "
                                "returns", self.rank, p, self.timeout, round)
                self.suspects[p] = 0 if probe[p] else self.suspects[p] + 1
        return torch.from_numpy(np.ascontiguousarray(y)).to(tensor.dtype).view_as(tensor), list(arrived)

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        x = tensor.detach().to("cpu", torch.float32).numpy()

        def run(col, x=x):
            out = col.allreduce(x, tensor=self.tensor)
            return out, col.records[-1].bytes_sent

        out, sent = self.state.submit(run).wait()
        self.bytes_sent += sent
        return torch.from_numpy(np.ascontiguousarray(out)).to(tensor.dtype).view_as(tensor)
