"""Rates, sizes and durations as people write them ("1gbit", "256k", "50ms"), parsed once for
the testbed, its CLI and the simulator.  Each parser raises ValueError naming the text."""

from __future__ import annotations

RATE_UNITS = {"tbit": 10**12, "gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1,
              "gbps": 8 * 10**9, "mbps": 8 * 10**6, "kbps": 8 * 10**3, "bps": 8}


def rate(text: str | int | float | None) -> int:
    """'1gbit', '100mbit', '500kbit', '10gbit', or bits/s as a number -> bits/s (0 = none)."""
    if text is None:
        return 0
    t = str(text).strip().lower()
    if t in ("", "0", "none", "off"):
        return 0
    num, mult = t, 1
    for suffix, m in RATE_UNITS.items():
        if t.endswith(suffix):
            num, mult = t[: -len(suffix)], m
            break
    try:
        bits = float(num) * mult
    except ValueError:
        raise ValueError(f"bad rate {text!r}: use e.g. 1gbit, 100mbit, 500kbit") from None
    if not 0 <= bits < 8 * 2**64:  # (NaN fails this too)
        raise ValueError(f"bad rate {text!r}: want 0 (none) or a positive rate such as 1gbit")
    return int(bits)


def rate_text(bits: float) -> str:
    """bits/s as tc writes a rate: 1gbit, 100mbit, 2.5gbit, 1kbit; 0: none."""
    if not bits:
        return "none"
    for suffix in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= RATE_UNITS[suffix]:
            return f"{bits / RATE_UNITS[suffix]:g}{suffix}"
    return f"{bits:g}bit"


def size(text: str | int) -> int:
    """'256k', '1m', '64kb', '1500' -> bytes."""
    if isinstance(text, int):
        return text
    t = str(text).strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"bad size {text!r}: use e.g. 64k, 1m, 1500") from None


def duration(text: str | float) -> float:
    """'50ms', '2s', '500us', '0.05' (seconds) -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    t = str(text).strip().lower()
    for suffix, mult in (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0), ("m", 60.0)):
        if t.endswith(suffix):
            t, m = t[: -len(suffix)], mult
            break
    else:
        m = 1.0
    try:
        return float(t) * m
    except ValueError:
        raise ValueError(f"bad duration {text!r}: use e.g. 50ms, 2s") from None
