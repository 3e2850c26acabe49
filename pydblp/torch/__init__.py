"""PyTorch integration: a DDP communication hook, sharded optimizers, a parameter broadcaster, DiLoCo.

Typical use, under ``torchrun`` (the default process group must be gloo: it
is the control plane, used here only for rendezvous)::

    dist.init_process_group("gloo")
    state = pydblp.torch.State.from_process_group(iface="eth0", config=Config(phase="dblp"))
    ddp.register_comm_hook(state, pydblp.torch.hook)
    state.warm_up(ddp)  # the data path's first rounds, before the first step's

Rendezvous: each rank publishes its data-plane address, port, MAC and queue
in the default store under ``pydblp/<job>/<world>/<n>/<rank>`` (``n``: the
how-many-th open of the job on that store, so a store that outlives a run
never answers with the last run's) and reads everyone else's.

Failure semantics (the collective's, see docs/protocol.md):

* Loss within a round's tolerance is absorbed by the estimator; loss above
  it is repaired by retransmission.  Nothing is raised for loss.
* A peer that stays silent for ``Config.peer_timeout`` seconds makes the
  round fail: the hook's future completes with :class:`CollectiveError`,
  which DDP raises from ``backward()``.  The state is then unusable.
* ``Config.deadline`` (off by default) lets a round end below its loss
  bound; the round record says so (``state.collective.records``).
"""


# No `from __future__ import annotations`: DDP checks the hook's annotations at runtime.
import dataclasses
import json
import logging
import queue as _queue
import threading

import numpy as np
import torch
import torch.distributed as dist

from pydblp import net, wire
from pydblp.jobkey import load_key, new_epoch
from pydblp.collective import Collective, CollectiveError, Config, estimators, link_chunk_bytes
from pydblp.collective.config import TENSOR_BROADCAST
from pydblp.collective.engine import warm_up_args
from pydblp.dataplane import check_kind, open_dataplane
from pydblp.torch._flat import assign, flatten

DEFAULT_CHUNK = Config().chunk_bytes  # 1408: fits MTU 1500
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb, for a module that is not a DDP one

log = logging.getLogger(__name__)

CLOSE_MARGIN = 5.0  # seconds past peer_timeout that close() waits for a round in progress to end

__all__ = ["State", "hook", "ParameterBroadcaster", "CollectiveError", "DiLoCo", "Exchange", "GlooExchange",
           "PydblpExchange", "ShardedSGD", "ShardedAdam", "BackendOptions", "ProcessGroupDblp"]


class State:
    """A collective plus the one thread that drives it (rounds run in submission order)."""

    def __init__(self, collective: Collective, owned=(), closing: tuple | None = None):
        self.collective = collective
        self.depth: dict[int, tuple[int, int]] = {}  # id(parameter) -> (layer, layers): register_model
        self._owned = list(owned)
        self._closing = closing  # (store, key prefix) where every rank posts its close: see close()
        self._jobs: _queue.Queue = _queue.Queue()
        self._failed: BaseException | None = None
        self._closed = False
        self._submit_lock = threading.Lock()  # (a job is never queued behind close()'s stop)
        self._thread = threading.Thread(target=self._loop, name="pydblp-rounds", daemon=True)
        self._thread.start()

    @classmethod
    def from_process_group(cls, transport: str = "udp", iface: str | None = None, netns: str | None = None,
                           port: int = wire.DEFAULT_PORT, queue: int | None = None, addr: str | None = None,
                           config: Config | None = None, store=None, spin: float = 0.0,
                           rate: float = 0, group: tuple | None = None,
                           key_file: str | None = None) -> "State":
        """Open the data plane on ``iface`` and rendezvous through torch.distributed's store.

        ``transport``: ``udp`` (any user), ``xsk`` (AF_XDP: root; attaches
        the host XDP program to ``iface`` unless ``dblp load`` already did) or
        ``xsk-ktx`` (AF_XDP receive, transmit through a kernel UDP socket on
        ``iface``: ``XskTransport(tx="kernel")``, paced by ``iface``'s qdisc;
        on veth the fastest of the three, see bench/README.md).
        ``addr`` overrides the address published to peers (default: the
        first IPv4 address of ``iface``).  ``spin``: seconds the receiver
        busy-polls before sleeping; 0 (default) suits ranks that share cores,
        a few hundred microseconds suits a dedicated core.  ``rate`` (bits/s,
        0: none) paces the xsk transport at a link's line rate: AF_XDP transmit
        bypasses qdiscs, so a TBF on ``iface`` does not limit it (``udp`` and
        ``xsk-ktx`` transmit through the qdisc and ignore ``rate``).
        ``queue``: the AF_XDP kinds bind one socket to this receive queue;
        None (default): one on every receive queue of ``iface`` (a NIC spreads
        flows over them).  The log's first line for the data plane says which
        queues and whether copy or zero-copy mode (``dp.describe()``).
        ``group`` with ``Config(allgather="broadcast")``: ``(address, port)`` every rank
        receives, e.g. the subnet's broadcast address (see :class:`~pydblp.collective.Collective`);
        every rank must listen on that ``port``.

        ``key_file``: the job key (docs/authentication.md), a file every rank
        reads for itself; None: ``DBLP_KEY_FILE`` or ``DBLP_KEY`` from the
        environment, else no key.  The key never passes through the store or
        the wire; rank 0 draws the run's epoch and publishes it in the store.
        With a key every packet is tagged and verified; ranks holding different
        keys fail their first round with one :class:`CollectiveError` naming the
        cause, within ``Config.peer_timeout``.  The AF_XDP kinds also bind every
        peer's rank to the address and MAC it published (the host program's
        ``peers`` map): a packet claiming a rank from elsewhere is dropped in XDP.

        ``Config(chunk_bytes=None)`` sizes chunks to the links: every rank
        publishes ``iface``'s MTU and all use :func:`~pydblp.collective.link_chunk_bytes`
        of the smallest (1408 at MTU 1500, 8000 at MTU 9000: 5.7x fewer packets
        a round), so the network between them must carry that MTU too, as a
        jumbo-frame fabric does.  A rank without ``iface`` has no MTU to give:
        then every rank uses the default, 1408.  ``state.collective.cfg.chunk_bytes``
        says what was chosen.
        """
        if not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group('gloo') first")
        return cls.open(store or dist.distributed_c10d._get_default_store(), dist.get_rank(),
                        dist.get_world_size(), transport=transport, iface=iface, netns=netns, port=port,
                        queue=queue, addr=addr, config=config, spin=spin, rate=rate, group=group,
                        key_file=key_file)

    @classmethod
    def open(cls, store, rank: int, world: int, transport: str = "udp", iface: str | None = None,
             netns: str | None = None, port: int = wire.DEFAULT_PORT, queue: int | None = None,
             addr: str | None = None,
             config: Config | None = None, spin: float = 0.0, rate: float = 0, group: tuple | None = None,
             key_file: str | None = None) -> "State":
        """:meth:`from_process_group` with the rendezvous given: ``store`` (a torch.distributed
        ``Store`` every rank shares), this ``rank`` and the ``world``; what the ``dblp`` backend
        (:mod:`pydblp.torch.backend`) calls before any process group exists.  Same arguments and
        errors otherwise."""
        cfg = config or Config()
        by_link = cfg.chunk_bytes is None  # the links decide, once every rank's MTU is known
        # before anything is opened or published
        (dataclasses.replace(cfg, chunk_bytes=DEFAULT_CHUNK) if by_link else cfg).check()
        cfg.check_group(group)
        check_kind(transport, iface)
        key = load_key(key_file)  # (KeyLoadError, one line, before anything opens)
        here = _rendezvous(store, cfg.job, world)
        # every rank learns the run's epoch, keyed or not, so a rank without the key fails on its
        # packets' missing tags instead of waiting here
        if rank == 0:
            store.set(f"{here}/epoch", str(new_epoch()))
        epoch = int(store.get(f"{here}/epoch"))
        # the widest chunk this rank may be given: AF_XDP frames must hold it with its headers
        mtu = net.iface_mtu(iface, netns) if iface and by_link else None
        widest = (link_chunk_bytes(mtu) if mtu else DEFAULT_CHUNK) if by_link else cfg.chunk_bytes
        dp = open_dataplane(transport, iface, netns=netns, port=port, queue=queue, addr=addr, job=cfg.job,
                            rank=rank, world=world, rate=rate, spin=spin, max_payload=widest, key=key,
                            epoch=epoch if key is not None else None, dscp=cfg.dscp)
        log.info("rank %d: data plane %s", rank, dp.describe())  # which queues, copy or zero-copy
        try:
            store.set(f"{here}/{rank}", json.dumps(dp.endpoint.as_dict()))
            recs = [json.loads(store.get(f"{here}/{r}")) for r in range(world)]
            # a routed peer's frames go to and come from a gateway: its own MAC is no use here
            macs = [p["mac"] if r == rank else dp.link_mac(p["addr"], p["mac"]) for r, p in enumerate(recs)]
            peers = [(p["addr"], p["port"], m) for p, m in zip(recs, macs)]
            if dp.host is not None:  # anti-spoofing: a peer's rank only from its own address
                for r, p in enumerate(recs):
                    if r != rank:
                        dp.host.bind_peer(cfg.job, r, ip=p["addr"], mac=macs[r])
            if by_link:  # every rank reads the same records, so every rank picks the same size
                mtus = [p.get("mtu") for p in recs]
                chunk = link_chunk_bytes(min(mtus)) if all(mtus) else DEFAULT_CHUNK
                cfg = dataclasses.replace(cfg, chunk_bytes=chunk)  # (<= widest: min(mtus) <= mine)
            col = Collective(dp.transport, rank, world, peers, cfg, group=group)
        except BaseException:  # nothing this call opened outlives it
            dp.close()
            raise
        return cls(col, owned=[col, dp], closing=(store, f"{here}/close"))

    def register_model(self, module: torch.nn.Module) -> None:
        """Describe ``module``'s layers for ``Config(priority="layer")``: a layer is a module
        holding parameters of its own, numbered in registration order (the model's order from input
        to output for sequential models), the same on every rank.  :func:`hook` then gives each
        bucket its chunks' classes (:func:`pydblp.collective.estimators.layer_classes`).
        """
        owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        self.depth = {id(p): (d, len(owners)) for d, m in enumerate(owners) for p in m.parameters(recurse=False)}

    def warm_up(self, model, rounds: int = 2) -> None:
        """Run the collective's first rounds now, not in the first step: ``rounds`` exact rounds
        of zeros (:meth:`pydblp.collective.Collective.warm_up`) as large as ``model``'s trainable
        parameters, up to its bucket cap (a DDP module's ``bucket_bytes_cap``; else DDP's
        default, 25 MiB), or of ``model`` values (an int).

        DDP's first step hands :func:`hook` a model under 25 MiB as one bucket, once the backward
        is done, and a process's first rounds cost up to twice a later one; over Gloo (and over
        the ``dblp`` backend) DDP's initial broadcast of the parameters has already used the
        sockets.  Call it on every
        rank after registering the hook and before the first backward.  Blocks until done.

        Args:
            model: a ``torch.nn.Module`` (a DDP one too), or the number of values.
            rounds: how many (default 2).

        Raises:
            ValueError: no trainable parameters, or a size or count out of range.
            CollectiveError: as a round.
        """
        if isinstance(model, torch.nn.Module):
            cap = getattr(model, "bucket_bytes_cap", DDP_BUCKET_BYTES) // 4  # (float32 values)
            size = min(sum(p.numel() for p in model.parameters() if p.requires_grad), cap)
            if size == 0:
                raise ValueError("warm_up: the model has no trainable parameters; give a number of values")
        else:
            size = model
        size, rounds = warm_up_args(size, rounds)  # (here: a bad argument must not fail the state)
        self.submit(lambda col: col.warm_up(size, rounds)).wait()

    @property
    def data_plane(self):
        """The :class:`~pydblp.dataplane.DataPlane` this state opened (its ``describe()``: queues,
        copy or zero-copy), or None when it was given a collective."""
        from pydblp.dataplane import DataPlane

        return next((o for o in self._owned if isinstance(o, DataPlane)), None)

    def host_counters(self) -> dict | None:
        """The host XDP program's counters on this rank's interface (:meth:`pydblp.host.HostMaps.counters`:
        verdicts, drops by reason, sheds by priority), or None: the ``udp`` kind has no host program."""
        host = next((o.host for o in self._owned if getattr(o, "host", None) is not None), None)
        return None if host is None else host.counters()

    def state_dict(self) -> dict:
        """The collective's state (:meth:`pydblp.collective.Collective.state_dict`: round counter,
        phase controller, fills), its arrays as CPU tensors: ``torch.save`` holds it and
        ``torch.load(weights_only=True)`` reads it back.  Taken on the transport thread after the
        rounds submitted so far; blocks for them.  Each rank saves its own.

        Raises:
            CollectiveError: a round failed (the state is unusable).
        """
        return _tensors(self.submit(lambda col: col.state_dict()).wait())

    def load_state_dict(self, state: dict) -> None:
        """Resume the collective from ``state`` (:meth:`state_dict` of this rank's, in an earlier run):
        only before the first round, on every rank before any rank begins one (e.g. before a
        barrier).  Raises what :meth:`pydblp.collective.Collective.load_state_dict` raises; the
        state stays usable."""
        self.collective.load_state_dict(_arrays(state))

    def submit(self, fn, *args) -> torch.futures.Future:
        """Run ``fn(collective, *args)`` on the transport thread; a future of its result.  On a
        closed state (:meth:`close`; the ``dblp`` backend closes its old state when the group
        re-forms) the future holds a RuntimeError at once: nothing would ever run the job."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._submit_lock:
            if not self._closed:
                self._jobs.put((fut, fn, args))
                return fut
        fut.set_exception(RuntimeError("this pydblp State is closed: open a new one (after the dblp group "
                                       "re-forms, take dist.group.WORLD.state again)"))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            if self._failed is not None:
                fut.set_exception(CollectiveError(f"an earlier round failed: {self._failed}"))
                continue
            try:
                fut.set_result(fn(self.collective, *args))
            except BaseException as e:  # completes the future; DDP raises it in backward()
                self._failed = e
                fut.set_exception(e)

    def close(self, barrier: bool = True) -> None:
        """Stop the thread, close the transport and detach what this state attached.

        A rank's round ends when it holds what it needs, which may be before a peer has what
        that peer needs from it.  So with ``barrier`` (default) this rank first posts its close
        in the rendezvous store and waits, at most ``Config.peer_timeout``, for every rank's,
        answering probes for the last round (its STOP may have been lost) and serving its
        trailing all-gather (a peer may still need a retransmission) meanwhile: no peer is
        stranded.  A rank that never posts (dead) costs the wait; this rank then logs a
        warning and closes anyway.  Skipped after a failed round, and for a state built
        around a :class:`~pydblp.collective.Collective` by hand (no store:
        :meth:`open` and :meth:`from_process_group` give one).
        """
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self.collective.hello = False  # (no more rounds: a peer waiting in one must find this rank gone)
        try:  # (an interrupt in a wait below still releases what the rounds no longer use)
            # a round in progress ends within peer_timeout: it completes or fails
            self._thread.join(timeout=self.collective.cfg.peer_timeout + CLOSE_MARGIN)
            if barrier and self._closing is not None and self._failed is None and self.collective.world > 1:
                self._wait_for_all()
        finally:
            self._release()

    def _release(self) -> None:
        """Close what this state owns (the collective, then the data plane), each even if one
        before it failed; never while the rounds thread, or the collective's idle responder,
        may still be using them (left to the process's exit then, with a warning)."""
        if self._thread.is_alive():
            log.warning("rank %d: a round is still running: its transport and data plane are left open "
                        "until the process exits", self.collective.rank)
            return
        errors = []
        owned, self._owned = self._owned, []
        for o in owned:
            try:
                if o.close() is False:  # (the collective's idle responder is inside a transport call)
                    log.warning("rank %d: the data plane stays open until the process exits: the "
                                "collective's responder still uses it", self.collective.rank)
                    break
            except Exception as e:  # the rest still close; the first error is raised after them
                log.error("rank %d: closing %s: %s", self.collective.rank, type(o).__name__, e)
                errors.append(e)
        if errors:
            raise errors[0]

    def _wait_for_all(self) -> None:
        """Post this rank's close in the store; wait for every rank's (see :meth:`close`)."""
        import datetime

        (store, prefix), col = self._closing, self.collective
        try:
            store.set(f"{prefix}/{col.rank}", "1")
            store.wait([f"{prefix}/{r}" for r in range(col.world) if r != col.rank],
                       datetime.timedelta(seconds=col.cfg.peer_timeout))
        except (RuntimeError, dist.DistError) as e:  # (a rank never closed, or the store's host is gone)
            log.warning("rank %d: closing before every rank did (%s); a peer still finishing the last "
                        "round may wait for this rank until its peer_timeout", col.rank, e)


def _rendezvous(store, job: int, world: int) -> str:
    """The store prefix of this open of ``job``'s ``world`` ranks: ``pydblp/<job>/<world>/<n>``,
    the ``n``-th open of them on ``store``.

    A store can outlive a run (a torchrun agent's store serves every process group the script
    creates, and a group re-created after ``destroy_process_group`` has the same name): read
    under a fixed key, the last run's epoch and endpoints would answer at once.  Each rank
    counts itself in; every rank of one open counts in before any rank of the next can (a
    rank leaves an open only with every rank's endpoint of it), so ``n`` is the count over
    ``world``, the same on every rank.
    """
    n = store.add(f"pydblp/{job}/{world}/joined", 1)
    return f"pydblp/{job}/{world}/{(n - 1) // world}"


def _tensors(obj):
    """``obj`` with every numpy array in it (through dicts, lists and tuples) a CPU tensor (on the
    array's memory)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return obj


def _arrays(obj):
    """``obj`` with every tensor in it a numpy array (a copy): :func:`_tensors` undone."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _arrays(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_arrays(v) for v in obj)
    return obj


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean gradient over ranks, through the bounded-loss collective.

    The future completes on the transport thread with the bucket's own
    buffer, the mean written into it (the round reads and writes a float32
    bucket in place; other dtypes go through a float32 copy).  DDP does not
    pre-divide: the hook returns the mean, as DDP's default allreduce hook
    does.  If the round fails the buffer holds anything.  A CUDA bucket is copied
    to pinned host memory on a side stream (the call returns at once, the copy
    overlaps the rounds before it) and the mean is copied back into it.

    The phase controller observes by training step (see
    :mod:`pydblp.collective.phase`): DDP runs one round per bucket, and DBLP's
    G is the norm of the whole step's averaged gradient.
    """
    buf = bucket.buffer()
    tensor_id = bucket.index() & 0xFFFF
    last = bucket.is_last()
    classes = _bucket_layers(state, bucket, buf.numel())
    if buf.is_cuda:  # copied on a side stream: this returns at once, the copy overlaps earlier rounds
        host, ready = _cuda_staging().down(buf)
    else:
        host, ready = buf.detach().reshape(-1).contiguous(), None

    def run(col: Collective):
        if classes is not None:
            col.set_layers(tensor_id, classes)
        if ready is not None:
            ready.synchronize()
        grad = host.to(torch.float32)  # (float32: host itself, so the round runs in place, as Gloo's)
        _stepped_allreduce(col, grad.numpy(), tensor_id, last)
        if ready is None:
            if grad.data_ptr() != buf.data_ptr():  # (another dtype, or a strided buffer: a copy ran)
                buf.copy_(grad.reshape(buf.shape))
            return buf
        _cuda_staging().up(grad, buf)
        _cuda_staging().release(host)  # (after the copy up: grad may be host itself)
        return buf

    return state.submit(run)


def _cuda_staging():
    """The process's CUDA staging (pinned buffers, a side stream per device), made on first use."""
    global _STAGING
    if _STAGING is None:
        from pydblp.torch.backend import _Staging

        _STAGING = _Staging()
    return _STAGING


_STAGING = None


def _bucket_layers(state: State, bucket, values: int):
    """The bucket's chunk classes under ``priority="layer"`` (its parameters' layers, in the
    bucket's order, which is its buffer's), or None: another priority, no model registered
    (``State.register_model``; the collective then ranks by position), or a parameter unknown."""
    cfg = state.collective.cfg
    if cfg.priority != "layer" or not state.depth:
        return None
    params = bucket.parameters()
    known = [state.depth.get(id(p)) for p in params]
    if None in known or sum(p.numel() for p in params) != values:
        return None
    return estimators.layer_classes([p.numel() for p in params], [d for d, _ in known], known[0][1],
                                    cfg.chunk_bytes // 4)


def _stepped_allreduce(col: Collective, grad: np.ndarray, tensor: int, last: bool) -> None:
    """One bucket's round, in place in ``grad`` (its mean replaces it), its controller counting
    steps; ``last`` closes the step (after its round: the transport thread runs a step's buckets in
    order, so every one of them is observed by then)."""
    col.controller.count_steps()
    col.allreduce(grad, tensor=tensor, out=grad)
    if last:
        col.end_step()


class ParameterBroadcaster:
    """Bounded-drift parameter broadcast (Weintraub et al.) every ``every`` steps.

    Shard owners broadcast the absolute values of their shard of the flat
    parameter vector; a chunk that does not arrive keeps this rank's own
    (stale) value.  Call :meth:`step` after each optimizer step.
    """

    TENSOR = TENSOR_BROADCAST  # (pydblp.collective.config.RESERVED_TENSORS)

    def __init__(self, state: State, module: torch.nn.Module, every: int = 1):
        if every < 1:
            raise ValueError("every must be >= 1")
        self.state, self.module, self.every = state, module, every
        self.steps = 0

    @torch.no_grad()
    def step(self) -> bool:
        """Broadcast if this is a k-th step; returns whether it did.  Blocks for the round."""
        self.steps += 1
        if self.steps % self.every:
            return False
        params = list(self.module.parameters())
        flat = flatten(params).numpy()
        out = self.state.submit(lambda col: col.broadcast_shards(flat, tensor=self.TENSOR)).wait()
        assign(params, torch.from_numpy(out))
        return True


# DiLoCo (exact and factored gossip) and the exchanges it runs over: pydblp.torch.diloco, .exchange
from pydblp.torch.diloco import DiLoCo  # noqa: E402
from pydblp.torch.exchange import Exchange, GlooExchange, PydblpExchange  # noqa: E402
# sharded optimizers (parameters all-gathered): pydblp.torch.sharded
from pydblp.torch.sharded import ShardedAdam, ShardedSGD  # noqa: E402
# the torch.distributed backend "dblp", registered on import: pydblp.torch.backend
from pydblp.torch.backend import BackendOptions, ProcessGroupDblp, register  # noqa: E402

register()
