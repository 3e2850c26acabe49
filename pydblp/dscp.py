"""Priority on the wire: the DSCP (IPv4 TOS byte, IPv6 traffic class) of each DBLP packet.

A DBLP packet's priority (the header's ``prio``: 1 most important .. 7
least, 0 for control packets) lives in the DBLP header, which no switch
reads.  Both transports also write it into the IP header as a DSCP
(RFC 2474), so a switch with DiffServ queues can act on it: the map from
``prio`` to DSCP is :data:`DEFAULT` unless ``Config.dscp`` says otherwise.

The default map keeps every DBLP packet in one assured-forwarding class
(AF4, RFC 2597) and spends its three drop precedences on the priority
bands::

    prio 0 (control)  AF41 (34)     prio 3, 4, 5  AF42 (36)
    prio 1, 2         AF41 (34)     prio 6, 7     AF43 (38)

Why one class: a switch queues an AF class in one queue and, under
congestion, drops its higher drop precedence first (WRED).  That is what a
priority-aware drop within a message's budget wants: least important chunks
go first, and nothing is reordered.  Classes in different queues (say CS1
for prio 7, or EF for control) would let a PROBE overtake the data it asks
about, and a BITMAP sent from that view asks for retransmissions of chunks
still queued; a scavenger class (LE, RFC 8622) may starve, and a starved
chunk must be repaired whole once a message's budget is spent.  Control
packets take AF41: dropped last, never ahead of their data.  Three
precedences are all an AF class has, so seven priorities share them.

``Config.dscp`` (see :func:`resolve`): ``"default"``, ``"off"`` (DSCP 0,
best effort: the IP header says nothing), or a map ``{prio: dscp}`` /
``"prio=dscp,..."`` string where a DSCP is 0..63 or a name (``AF41``,
``EF``, ``CS1``, ``LE``, ``BE``...); priorities left out take the default.

The reverse direction, :func:`prio_table`, gives the host program and the
fabric (``classify="dscp"``) a priority per DSCP: the most important
priority the map sends with it (AF41 -> 1, AF42 -> 3, AF43 -> 6 by default;
a DSCP the map never uses -> 0, never shed).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pydblp import wire

NAMES = {"BE": 0, "CS0": 0, "LE": 1, "EF": 46, "VA": 44,
         **{f"CS{i}": 8 * i for i in range(1, 8)},
         **{f"AF{c}{d}": 8 * c + 2 * d for c in range(1, 5) for d in range(1, 4)}}
DEFAULT = {0: NAMES["AF41"], 1: NAMES["AF41"], 2: NAMES["AF41"], 3: NAMES["AF42"], 4: NAMES["AF42"],
           5: NAMES["AF42"], 6: NAMES["AF43"], 7: NAMES["AF43"]}
SPECS = ("default", "off")


def name(dscp: int) -> str:
    """``dscp``'s name (``AF41``, ``EF``, ``CS6``...), else its number as a string."""
    for k, v in NAMES.items():
        if v == dscp and k not in ("CS0",):
            return k
    return str(dscp)


def _value(v, where: str) -> int:
    if isinstance(v, str):
        key = v.strip().upper()
        if key in NAMES:
            return NAMES[key]
        if not key.isdigit():
            raise ValueError(f"{where}: {v!r} is no DSCP; give 0..63 or a name such as AF41, EF, CS1")
        v = int(key)
    if not isinstance(v, (int, np.integer)) or not 0 <= v <= 63:
        raise ValueError(f"{where}: DSCP {v!r}; give 0..63 or a name such as AF41, EF, CS1")
    return int(v)


def resolve(spec) -> np.ndarray:
    """The DSCP of each priority 0..7 as an array of 8 (``spec`` as ``Config.dscp``).

    Args:
        spec: ``"default"``, ``"off"``, a ``{prio: dscp}`` mapping or a
            ``"prio=dscp,..."`` string (DSCPs as numbers or names).

    Raises:
        ValueError: a spec that is none of those, a priority outside 0..7 or a
            DSCP outside 0..63, in one line naming the fix.
    """
    if isinstance(spec, str) and spec in SPECS:
        return np.array([DEFAULT[p] if spec == "default" else 0 for p in range(wire.MAX_PRIO + 1)], np.uint8)
    if isinstance(spec, str):
        pairs = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            p, eq, d = item.partition("=")
            if not eq or not p.strip().isdigit():
                raise ValueError(f"dscp {spec!r}: use default, off or PRIO=DSCP,... (e.g. 0=EF,7=CS1)")
            pairs[int(p)] = d
        spec = pairs
    if not isinstance(spec, Mapping):
        raise ValueError(f"dscp {spec!r}: use default, off, a {{prio: dscp}} map or PRIO=DSCP,...")
    out = np.array([DEFAULT[p] for p in range(wire.MAX_PRIO + 1)], np.uint8)
    for p, d in spec.items():
        if not isinstance(p, (int, np.integer)) or not 0 <= p <= wire.MAX_PRIO:
            raise ValueError(f"dscp: priority {p!r}; use 0..{wire.MAX_PRIO}")
        out[p] = _value(d, f"dscp of priority {p}")
    return out


ECT0 = 0b10  # ECN field: ECN-capable transport (RFC 3168), what pydblp sends with ``ect``
CE = 0b11    # ECN field: congestion experienced (a switch's mark)


def tos_table(spec, ect: bool = False) -> np.ndarray | None:
    """The IP TOS / traffic-class byte (DSCP << 2, ECN bits ECT(0) with ``ect``, else 0) per header
    ``prio`` byte 0..255, or None when every byte would be 0 (nothing to write).  A prio above 7
    (not a DBLP priority) takes priority 0's.
    """
    d = resolve(spec)
    if not d.any() and not ect:
        return None
    table = np.full(256, d[0] << 2, np.uint8)
    table[: len(d)] = d << 2
    if ect:
        table |= ECT0
    return table


def prio_table(spec) -> np.ndarray:
    """DSCP 0..63 -> priority: the most important priority 1..7 the map sends with that DSCP, 0
    when only control (or nothing) uses it (a classifier never sheds 0)."""
    d = resolve(spec)
    out = np.zeros(64, np.uint8)
    for p in range(wire.MAX_PRIO, 0, -1):  # the last write, the smallest priority, wins
        out[d[p]] = p
    return out
