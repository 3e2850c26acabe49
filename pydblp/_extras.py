"""Optional dependencies: which ``pip install 'pydblp[EXTRA]'`` provides each.

The core (wire format, transports, collective, host program, testbed, torch
hook) needs only numpy, torch and pyroute2.  Decoding captures needs scapy
(extra ``inspect``); the main job (``dblp experiment``) needs scikit-learn
for its data set and matplotlib for its plots (extra ``experiment``).
Modules that use them call :func:`require` first, so a missing one is one
line naming the extra instead of a traceback.
"""

from __future__ import annotations

import importlib.util

# import name -> (distribution name, extra that installs it)
OPTIONAL = {
    "scapy": ("scapy", "inspect"),
    "sklearn": ("scikit-learn", "experiment"),
    "matplotlib": ("matplotlib", "experiment"),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


def require(what: str, *modules: str) -> None:
    """Raise :class:`MissingExtra` unless every module in ``modules`` can be imported.

    Args:
        what: the feature that needs them, as the user knows it (e.g. ``dblp dump``).
        modules: import names, keys of :data:`OPTIONAL`.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        dists = ", ".join(OPTIONAL[m][0] for m in missing)
        extras = ",".join(sorted({OPTIONAL[m][1] for m in missing}))
        raise MissingExtra(f"{what} needs {dists}: pip install 'pydblp[{extras}]'")
