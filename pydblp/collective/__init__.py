"""Bounded-loss collectives: transpose allreduce and parameter server over a Transport.

Pure numpy: usable without torch.  See :mod:`pydblp.collective.core` for the
protocol and failure semantics, :mod:`~pydblp.collective.estimators` for the
estimators and priorities, :mod:`~pydblp.collective.phase` for tolerance control.
"""

from pydblp.collective.core import Collective, CollectiveError, Config, RoundRecord, link_chunk_bytes
from pydblp.collective.phase import Dblp, PhaseController, Schedule, Static

__all__ = ["Collective", "CollectiveError", "Config", "RoundRecord", "link_chunk_bytes",
           "PhaseController", "Static", "Dblp", "Schedule"]
