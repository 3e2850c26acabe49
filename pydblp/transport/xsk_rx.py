"""The receive copy paths of :class:`~pydblp.transport.xsk.XskTransport`: rx descriptors to a :class:`Batch`.

With the compiled loops (``native``), :meth:`XskReceive._recv_native` takes
every batch but one with multi-buffer frames in one C call (``dblp_xsk_rx``:
the general path below, packet by packet, lending the frames with
``copy=False`` when the batch is the run path's shape).  The Python paths
stay the reference, and take multi-buffer batches on either path.
Four of them, fastest first, each falling back to the next when the batch is
not its shape:

* :meth:`XskReceive._recv_run`: consecutive UMEM frames, one header layout,
  all valid: a few numpy calls; with ``copy=False`` the payload rows are the
  UMEM frames themselves (lent until the next receive).
* the general path of :meth:`XskReceive._receive`: any frames, copied in
  runs of consecutive frames, invalid ones dropped and counted.
* :meth:`XskReceive._recv_sg_uniform`: multi-buffer frames (``XDP_PKT_CONTD``)
  all of the same shape: one strided copy per segment index.
* :meth:`XskReceive._recv_sg`: any multi-buffer frames, gathered segment by segment.

Every path hands the frames it consumed back to the fill ring (except those
it lends), counts ``rx_packets``, ``rx_bytes``, ``rx_invalid`` and
``rx_truncated``, and, where ``into.ecn`` is an array, writes each returned
packet's ECN field there (the IPv4 TOS / IPv6 traffic class's low two bits,
:func:`~pydblp.transport.frames.ecn_of`; rows compacted with the rest).
"""

from __future__ import annotations

import numpy as np

from pydblp import wire
from pydblp.transport import frames
from pydblp.transport.base import Batch
from pydblp.transport.xsk_ring import XDP_PKT_CONTD


class XskReceive:
    """Mixin: the receive copy paths over the socket's rx ring and UMEM.

    The class it is mixed into provides ``_rx`` (the rx :class:`~pydblp.transport.xsk_ring.Ring`),
    ``_umem`` and ``_umem2d`` (the UMEM as bytes and as ``[frame, byte]``),
    ``frame_size``, ``port``, ``sg``, ``_validated`` (the host program checked every
    header), ``_sources`` (:class:`~pydblp.transport.frames.Sources`), ``_c`` (counters),
    ``_lent``, ``_fill_push(addrs)``, and for the C path ``_xlib`` (None: Python only),
    ``_xaddr``, ``_xres``, ``_xtaken`` and ``_fill_pending``.
    """

    def _recv_native(self, into: Batch, avail: int, cap: int, copy: bool) -> Batch | None:
        """``_receive`` in one C call; None (nothing consumed) for a batch it leaves to Python:
        multi-buffer frames, or an ``into`` whose arrays are not the layout C writes."""
        h, pay, ln, peer, ecn = into.headers, into.payload, into.lengths, into.peer, into.ecn
        xi = self._xinto  # the last batch's arrays and their addresses: most calls receive into the same one
        if not (xi is not None and xi[0] is h and xi[1] is pay and xi[2] is ln and xi[3] is peer and xi[4] is ecn):
            n = len(h)  # (C writes n rows of every array: each must have them, writeable)
            if not (h.flags.c_contiguous and h.dtype == wire.HEADER_DTYPE and pay.ndim == 2 and pay.strides[1] == 1
                    and pay.strides[0] >= pay.shape[1] and len(pay) >= n and ln.dtype == np.int32
                    and ln.flags.c_contiguous and len(ln) >= n and peer.dtype == np.int32
                    and peer.flags.c_contiguous and len(peer) >= n
                    and all(a.flags.writeable for a in (h, pay, ln, peer))
                    and (ecn is None or (ecn.dtype == np.uint8 and ecn.flags.c_contiguous and len(ecn) >= n
                                         and ecn.flags.writeable))):
                return None
            # (C's argument order after the ring context and the count: headers, payload, its row
            # stride and width, lengths, peer, ecn; NULL ecn: not reported)
            xi = self._xinto = (h, pay, ln, peer, ecn, h.ctypes.data, pay.ctypes.data, pay.strides[0], pay.shape[1],
                                ln.ctypes.data, peer.ctypes.data, None if ecn is None else ecn.ctypes.data)
        refill = copy and not len(self._fill_pending)  # pending frames go back first, in order
        got = self._xlib.dblp_xsk_rx(self._xaddr["rx"], min(avail, cap), *xi[5:], not copy, refill,
                                     self._xaddr["res"])
        r = self._xres
        if got < 0:
            return None
        self._taking = None  # consumed and refilled (or lent) in the call: nothing to give back on an error
        res = r.tolist()
        k, lent, base, w, invalid, trunc, nbytes, filled, left = res
        if lent:  # payloads stay in their UMEM frames, refilled at the next receive
            self._lent = self._xtaken[:got].copy()
        elif filled < left:  # behind frames still pending for the fill ring
            self._fill_push(self._xtaken[filled:left].copy())
        return self._recv_done(into, got, res)

    def _recv_done(self, into: Batch, got: int, res: list) -> Batch:
        """The batch ``dblp_xsk_rx`` wrote ``into`` (its ``got`` descriptors' frames already given
        back or lent): counters, and the payload rows lent from the UMEM when it lent them."""
        k, lent, base, w, invalid, trunc, nbytes = res[:7]
        c = self._c
        c["rx_packets"] += k
        c["rx_bytes"] += nbytes
        c["rx_invalid"] += invalid
        c["rx_truncated"] += trunc
        into.n = k
        if lent:
            f0, s0 = divmod(base, self.frame_size)
            return Batch(into.headers[:k], self._umem2d[f0: f0 + k, s0: s0 + w], into.lengths[:k], into.peer[:k], k,
                         None, None if into.ecn is None else into.ecn[:k])
        return into.view(0, k)

    def _receive(self, into: Batch, cons: int, avail: int, cap: int, copy: bool) -> Batch:
        """Take up to ``cap`` of the ``avail`` frames from rx ring index ``cons`` into ``into``."""
        rx = self._rx
        n = min(avail, cap)
        if n == 0:
            into.n = 0
            return into.view(0, 0)
        if self._xlib is not None:
            got = self._recv_native(into, avail, cap, copy)
            if got is not None:
                return got
        d = rx.at(cons, n)
        if self.sg and d["options"].any():  # frames spanning descriptors (multi-buffer)
            return self._recv_sg(into, cons, avail, cap)
        fs = self.frame_size
        addr = d["addr"].astype(np.int64)
        flen = d["len"].astype(np.int64)
        rx.consume(cons, n)  # descriptors copied; frames stay ours until refilled
        self._taken = addr
        run = self._recv_run(into, addr, flen, n, copy) if (addr[1:] - addr[:-1] == fs).all() else None
        if run is not None:
            return run
        frame = addr // fs
        foff = addr - frame * fs
        pw = frames.PARSE_WIDTH
        # the kernel takes fill-ring frames in order and we refill in order, so
        # frames arrive in consecutive runs: copy runs as slices (one copy, no
        # fancy-index temporary), a loop over runs (1-2 a call), not packets
        uniform = bool(np.all(foff == foff[0])) and foff[0] + pw <= fs
        runs = np.flatnonzero(np.diff(frame) != 1) + 1
        if uniform:
            f0 = int(foff[0])
            if len(runs) <= 8:
                block = np.empty((n, pw), np.uint8)
                for lo, hi in zip((0, *runs), (*runs, n)):
                    block[lo:hi] = self._umem2d[frame[lo]: frame[lo] + hi - lo, f0: f0 + pw]
            else:
                block = self._umem2d[frame, f0: f0 + pw]
        else:
            idx = np.minimum(addr[:, None] + np.arange(pw), (frame[:, None] + 1) * fs - 1)
            block = self._umem[idx]
        ok, off, plen, fam = frames.parse(block, flen, self.port)
        hdrs = wire.decode_batch(block, off)
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        allok = bool(ok.all())
        sel = np.arange(n) if allok else np.flatnonzero(ok)
        k = len(sel)
        self._c["rx_invalid"] += n - k
        if k:
            lens = self._headers_in(into, hdrs if allok else wire.take(hdrs, sel), plen[sel])
            w = int(lens.max())
            start = foff[sel] + off[sel] + wire.HEADER_LEN
            if w:
                s0 = int(start[0])
                fsel = frame[sel]
                if np.all(start == s0) and s0 + w <= fs:
                    sruns = runs if allok else np.flatnonzero(np.diff(fsel) != 1) + 1
                    if len(sruns) <= 8:
                        for lo, hi in zip((0, *sruns), (*sruns, k)):
                            into.payload[lo:hi, :w] = self._umem2d[fsel[lo]: fsel[lo] + hi - lo, s0: s0 + w]
                    else:
                        into.payload[:k, :w] = self._umem2d[fsel, s0: s0 + w]
                else:
                    for s in np.unique(start):  # a loop over distinct offsets (IPv4 vs IPv6), not packets
                        rows = np.flatnonzero(start == s)
                        ww = min(w, fs - int(s))
                        into.payload[rows, :ww] = self._umem2d[fsel[rows], int(s): int(s) + ww]
            kept = block if allok else block[sel]
            into.peer[:k] = self._sources.match(kept, fam[sel])
            if into.ecn is not None:
                into.ecn[:k] = frames.ecn_of(kept, fam[sel])
            self._c["rx_packets"] += k
            self._c["rx_bytes"] += int(lens.sum()) + k * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = k
        return into.view(0, k)


    def _headers_in(self, into: Batch, hdrs: np.ndarray, plen: np.ndarray) -> np.ndarray:
        """Put valid packets' headers and payload lengths (cut to ``into``'s width, counted) in ``into``."""
        k = len(hdrs)
        wire.put(into.headers[:k], hdrs)
        lens = plen - wire.HEADER_LEN
        trunc = lens > into.maxlen
        if trunc.any():
            self._c["rx_truncated"] += int(trunc.sum())
            lens = np.minimum(lens, into.maxlen)
        into.lengths[:k] = lens
        return lens

    def _recv_sg(self, into: Batch, cons: int, avail: int, cap: int) -> Batch:
        """``recv`` for a batch with frames spanning descriptors (``XDP_PKT_CONTD``).

        Takes up to ``cap`` whole frames.  Headers come from each frame's
        first descriptor (it holds at least the first ~3.8 KB); the payload
        is gathered segment by segment: one numpy copy per segment index
        (a handful), not per packet.  The payload is always copied.
        """
        rx, fs = self._rx, self.frame_size
        # a copy: the slots are handed back below, before their descriptors are read
        dd = rx.desc[(cons + np.arange(avail)) & rx.mask]
        ends = np.flatnonzero((dd["options"] & XDP_PKT_CONTD) == 0)  # last descriptor of each frame
        npk = min(len(ends), cap)
        if npk == 0:  # the kernel publishes whole frames; nothing complete yet
            into.n = 0
            return into.view(0, 0)
        ndesc = int(ends[npk - 1]) + 1
        rx.consume(cons, ndesc)
        addr = dd["addr"][:ndesc].astype(np.int64)
        self._taken = addr
        dlen = dd["len"][:ndesc].astype(np.int64)
        first = np.concatenate(([0], ends[: npk - 1] + 1))
        nseg = ends[:npk] - first + 1
        flen = np.add.reduceat(dlen, first)
        frame = addr // fs
        fast = self._recv_sg_uniform(into, addr, dlen, frame, nseg, flen)
        if fast is not None:
            return fast
        a0 = addr[first]
        pw = frames.PARSE_WIDTH
        block = self._umem[np.minimum(a0[:, None] + np.arange(pw), (frame[first][:, None] + 1) * fs - 1)]
        ok, off, plen, fam = frames.parse(block, flen, self.port)
        hdrs = wire.decode_batch(block, off)
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        ok &= dlen[first] >= off + wire.HEADER_LEN  # the DBLP header lies in the first descriptor
        sel = np.flatnonzero(ok)
        k = len(sel)
        self._c["rx_invalid"] += npk - k
        if k:
            lens = self._headers_in(into, wire.take(hdrs, sel), plen[sel])
            maxlen = into.maxlen
            col = np.zeros(k, np.int64)  # payload bytes of each packet placed so far
            skip = off[sel] + wire.HEADER_LEN  # headers before the payload, first segment only
            for j in range(int(nseg[sel].max())):
                rows = np.flatnonzero((nseg[sel] > j) & (col < lens))
                if not len(rows):
                    break
                di = first[sel[rows]] + j
                src = addr[di] + (skip[rows] if j == 0 else 0)
                seg = np.minimum(dlen[di] - (skip[rows] if j == 0 else 0), lens[rows] - col[rows])
                fr, so = src // fs, src % fs
                # one copy per distinct (offset in frame, offset in payload): one or two per segment
                key = so * (maxlen + 1) + col[rows]
                for kv in np.unique(key):
                    g = np.flatnonzero(key == kv)
                    o, c = int(so[g[0]]), int(col[rows[g[0]]])
                    w = int(seg[g].max())
                    into.payload[rows[g], c: c + w] = self._umem2d[fr[g], o: o + w]
                col[rows] += seg
            into.peer[:k] = self._sources.match(block[sel], fam[sel])
            if into.ecn is not None:
                into.ecn[:k] = frames.ecn_of(block[sel], fam[sel])
            self._c["rx_packets"] += k
            self._c["rx_bytes"] += int(lens.sum()) + k * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = k
        return into.view(0, k)

    def _recv_sg_uniform(self, into: Batch, addr, dlen, frame, nseg, flen) -> Batch | None:
        """``_recv_sg`` for the usual batch: every frame in the same number of descriptors, in
        consecutive UMEM frames at one offset, one layout, all valid.  Each segment index is one
        strided copy; None (nothing consumed from ``into``'s view) lets the general path run."""
        fs = self.frame_size
        k, npk, ndesc = int(nseg[0]), len(nseg), len(addr)
        f0, o = int(frame[0]), int(addr[0]) - int(frame[0]) * fs
        full = fs - o  # every descriptor but a frame's last is filled to its frame's end
        pw = frames.PARSE_WIDTH
        if not ((nseg == k).all() and int(frame[-1]) - f0 == ndesc - 1 and (np.diff(frame) == 1).all()
                and (addr - frame * fs == o).all() and o + pw <= fs and npk <= into.cap
                and into.headers.flags.c_contiguous):
            return None
        seg = self._umem2d[f0: f0 + ndesc].reshape(npk, k, fs)  # [packet, segment, byte]: a view
        dl = dlen.reshape(npk, k)
        if not (dl[:, :-1] == full).all():
            return None
        block = seg[:, 0, o: o + pw]
        parsed = frames.parse_uniform(block, flen, self.port)
        if parsed is None:
            return None
        ok, hoff, plen, fam = parsed
        hdrs = into.headers[:npk]
        hdrs.view(np.uint8).reshape(npk, wire.HEADER_LEN)[:] = block[:, hoff: hoff + wire.HEADER_LEN]
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        lens = plen - wire.HEADER_LEN
        skip = hoff + wire.HEADER_LEN
        c = full - skip  # payload bytes in a first segment
        if not ok.all() or c < 0 or k < 2 or int(lens.max()) > into.maxlen or c > into.maxlen:
            return None
        pay = into.payload
        pay[:npk, :c] = seg[:, 0, o + skip: fs]
        for j in range(1, k):
            w = full if j < k - 1 else min(int(dl[:, j].max()), into.maxlen - c)
            if w > 0:
                pay[:npk, c: c + w] = seg[:, j, o: o + w]
            c += w
        into.lengths[:npk] = lens
        into.peer[:npk] = self._sources.match(block, fam)
        if into.ecn is not None:
            into.ecn[:npk] = frames.ecn_of(block, fam)
        self._c["rx_packets"] += npk
        self._c["rx_bytes"] += int(lens.sum()) + npk * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = npk
        return into.view(0, npk)

    def _recv_run(self, into: Batch, addr: np.ndarray, flen: np.ndarray, n: int, copy: bool) -> Batch | None:
        """``recv`` for the usual case, in few numpy calls: consecutive frames, one layout, all valid.

        Returns the received batch (with ``copy=False`` its payload rows are
        the UMEM frames themselves, refilled at the next ``recv``), or None
        (frames not refilled; ``into`` may hold scratch the general path
        overwrites) to let that path handle the batch.
        """
        fs = self.frame_size
        a0 = int(addr[0])
        f0, o0 = a0 // fs, a0 % fs
        pw = frames.PARSE_WIDTH
        if o0 + pw > fs or n > into.cap or not into.headers.flags.c_contiguous:
            return None
        block = self._umem2d[f0: f0 + n, o0: o0 + pw]
        parsed = frames.parse_uniform(block, flen, self.port)
        if parsed is None:
            return None
        ok, hoff, plen, fam = parsed
        hdrs = into.headers[:n]  # header bytes straight into the caller's records
        hdrs.view(np.uint8).reshape(n, wire.HEADER_LEN)[:] = block[:, hoff: hoff + wire.HEADER_LEN]
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        if not ok.all():
            return None
        lens = plen - wire.HEADER_LEN
        w = int(lens.max())
        s0 = o0 + hoff + wire.HEADER_LEN
        if w > into.maxlen or s0 + w > fs:
            return None
        into.lengths[:n] = lens
        into.peer[:n] = self._sources.match(block, fam)
        ecn = into.ecn
        if ecn is not None:
            ecn[:n] = frames.ecn_of(block, fam)
            ecn = ecn[:n]
        self._c["rx_packets"] += n
        self._c["rx_bytes"] += int(lens.sum()) + n * wire.HEADER_LEN
        into.n = n
        lent = (addr - o0).astype(np.uint64)
        if not copy:  # lend the frames: no payload copy; they go back to the fill ring next call
            self._lent = lent
            return Batch(into.headers[:n], self._umem2d[f0: f0 + n, s0: s0 + w], into.lengths[:n],
                         into.peer[:n], n, None, ecn)
        into.payload[:n, :w] = self._umem2d[f0: f0 + n, s0: s0 + w]
        self._fill_push(lent)
        return into.view(0, n)
