"""Planning before launch: each rank's K-FAC memory and traffic under every placement, without training.

:func:`plan_job` builds the real curvature blocks of a model (on the meta device if it likes) and asks the real
placement plan, for every rank of a world size, what it holds and what it sends; :func:`read_job` reads a DeepSpeed
JSON. ``python -m ds_kfac.plan`` prints it for BERT (docs/placement.md, "Planning before launch").
"""

from .costs import BlockSizes, Gradients, RankCost, block_sizes, rank_cost
from .job import Job, read_job
from .placements import FRACTIONS, REDUCTIONS, PlacementCost, Plan, plan_job

__all__ = [
    "FRACTIONS",
    "REDUCTIONS",
    "BlockSizes",
    "Gradients",
    "Job",
    "PlacementCost",
    "Plan",
    "RankCost",
    "block_sizes",
    "plan_job",
    "rank_cost",
    "read_job",
]
