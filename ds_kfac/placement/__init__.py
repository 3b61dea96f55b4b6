"""Placement: who does which K-FAC work (the plan), carrying it out, and where gradients lie."""

from .agreement import refuse_layers_differing_between_ranks
from .distributor import Distributor
from .gradients import Fragment, GradientLayout, PartitionedGradients, WholeGradients
from .kl_clip import KLClip
from .plan import LayerPlacement, LayerShape, PlacementPlan, UnitShape, lpt, workers_per_layer
from .roles import RankRoles, Roles
from .tensor_parallel import TensorParallelGradients, TensorParallelLayers, split_tensor_parallel
from .work import LayerWork, all_finite_fragments, blocks_of, gather_work, write_work

__all__ = [
    "Distributor",
    "Fragment",
    "GradientLayout",
    "KLClip",
    "LayerWork",
    "LayerPlacement",
    "LayerShape",
    "UnitShape",
    "PartitionedGradients",
    "PlacementPlan",
    "RankRoles",
    "Roles",
    "TensorParallelGradients",
    "TensorParallelLayers",
    "WholeGradients",
    "all_finite_fragments",
    "blocks_of",
    "gather_work",
    "lpt",
    "refuse_layers_differing_between_ranks",
    "split_tensor_parallel",
    "workers_per_layer",
    "write_work",
]
