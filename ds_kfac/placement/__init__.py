"""Placement: who does which K-FAC work (the plan), carrying it out, and where gradients lie."""

from .distributor import Distributor
from .gradients import Fragment, GradientLayout, PartitionedGradients, WholeGradients
from .plan import LayerPlacement, LayerShape, PlacementPlan, UnitShape, lpt, workers_per_layer
from .tensor_parallel import TensorParallelGradients, TensorParallelLayers, split_tensor_parallel

__all__ = [
    "Distributor",
    "Fragment",
    "GradientLayout",
    "LayerPlacement",
    "LayerShape",
    "UnitShape",
    "PartitionedGradients",
    "PlacementPlan",
    "TensorParallelGradients",
    "TensorParallelLayers",
    "WholeGradients",
    "lpt",
    "split_tensor_parallel",
    "workers_per_layer",
]
