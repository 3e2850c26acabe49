"""Bounded-loss collectives over a Transport: allreduce (transpose or parameter server),
reduce-scatter, all-gather, shard broadcast, sharded optimizer updates and neighbour rounds.

Pure numpy: usable without torch.  The protocol, its bounds and failure semantics are
described in docs/protocol.md.  Modules: :mod:`~pydblp.collective.engine` (:class:`Collective`),
:mod:`~pydblp.collective.protocol` (one rank's rounds, step by step),
:mod:`~pydblp.collective.rounds` (one round type per kind of round),
:mod:`~pydblp.collective.fill` (what a result row that did not arrive becomes),
:mod:`~pydblp.collective.matcher` (the receive path), :mod:`~pydblp.collective.messages`
(per-message state), :mod:`~pydblp.collective.config` (knobs, records, constants),
:mod:`~pydblp.collective.estimators` (estimators and priorities),
:mod:`~pydblp.collective.phase` (tolerance control).
"""

from pydblp.collective.config import CollectiveError, Config, RoundRecord, link_chunk_bytes
from pydblp.collective.engine import Collective
from pydblp.collective.phase import Dblp, PhaseController, Schedule, Static

__all__ = ["Collective", "CollectiveError", "Config", "RoundRecord", "link_chunk_bytes",
           "PhaseController", "Static", "Dblp", "Schedule"]
