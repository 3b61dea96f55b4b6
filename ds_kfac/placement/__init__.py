"""Placement: who does which K-FAC work (the plan), carrying it out, and where gradients lie."""

from .distributor import Distributor
from .gradients import Fragment, GradientLayout, PartitionedGradients, WholeGradients
from .plan import LayerPlacement, LayerShape, PlacementPlan, lpt, workers_per_layer

__all__ = [
    "Distributor",
    "Fragment",
    "GradientLayout",
    "LayerPlacement",
    "LayerShape",
    "PartitionedGradients",
    "PlacementPlan",
    "WholeGradients",
    "lpt",
    "workers_per_layer",
]
