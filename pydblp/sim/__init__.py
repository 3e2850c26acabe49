"""A deterministic simulator of the real protocol: N ranks in one process, in virtual time.

Each rank runs the unchanged :class:`~pydblp.collective.Collective` over a simulated transport
(:class:`~pydblp.sim.transport.SimTransport`) on a simulated switch
(:class:`~pydblp.sim.network.Network`: per-link rate and latency, finite queues, the testbed
fabric's Bernoulli, Gilbert-Elliott and burst loss, dead ranks).  Nothing reads the real clock:
a seed gives byte-identical round records on every run.  docs/simulator.md describes it.

>>> import numpy as np
>>> from pydblp.sim import Sim, Link
>>> sim = Sim(4, link=Link("1gbit"), seed=1)
>>> sim.network.loss(0.1)
>>> nodes = sim.run(lambda node: node.collective.allreduce(np.ones(1000, np.float32)))
"""

from pydblp.sim.core import Node, Sim, SimError
from pydblp.sim.network import Burst, Faults, Link, Network
from pydblp.sim.transport import SimTransport, rank_addr

__all__ = ["Sim", "Node", "SimError", "Link", "Network", "Faults", "Burst", "SimTransport", "rank_addr"]
