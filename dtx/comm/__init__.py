"""The workers' communication floor: who talks to whom, and what it costs.

Faces of the Hitchhiker's Guide §3.2 (All-Reduce algorithms) and Das et al. §3 (the α–β cost of
an exchange): the per-step context a strategy sends through (:mod:`dtx.comm.context`), the
α–β cost model and traffic accountant (:mod:`dtx.comm.costmodel`), the allreduce algorithms
(:mod:`dtx.comm.collectives`) and their message schedules (:mod:`dtx.comm.schedules`), gossip
topologies (:mod:`dtx.comm.topology`) and what a compiled program sends (:mod:`dtx.comm.hlo`).
"""

from __future__ import annotations

from dtx.comm import collectives, costmodel, hlo, schedules, topology  # noqa: F401
from dtx.comm.context import (  # noqa: F401
    Capabilities, CommContext, allreduce_traffic, compiler, count_scalar, pmean_traffic, psum_traffic, silent, traffic_stats, worker_index,
)
