"""Emulated cluster in network namespaces with a misbehaving switch (XDP).

See :class:`Testbed` (core.py) and :class:`Fabric` (fabric.py); the CLI is
``dblp testbed`` / ``dblp fault``.
"""

from pydblp.testbed.core import (DEFAULT_RATE, STATE_DIR, Testbed, TestbedError, names, read_state,
                                 resolve, status, teardown, teardown_all, worker_addr, worker_mac)
from pydblp.testbed.fabric import Fabric, FabricError, PortConfig

__all__ = ["Testbed", "TestbedError", "Fabric", "FabricError", "PortConfig", "DEFAULT_RATE",
           "STATE_DIR", "names", "read_state", "resolve", "status", "teardown", "teardown_all",
           "worker_addr", "worker_mac"]
