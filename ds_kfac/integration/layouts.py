"""Where DeepSpeed's ZeRO optimizers keep the reduced gradients: the :class:`~ds_kfac.placement.GradientLayout`
of each ZeRO stage, built once by :class:`~ds_kfac.integration.engine.KFACEngine`.

The DeepSpeed internals these read are listed in docs/maintainers.md.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist
from torch import nn

from ..placement import Fragment, GradientLayout, PartitionedGradients, WholeGradients


class Zero12Gradients(PartitionedGradients):
    """ZeRO 1/2: this rank's fragment of each parameter's reduced gradient, through the fragment mapping
    DeepSpeed attaches to every parameter (the same one behind ``deepspeed.utils.safe_get_full_grad``),
    without that function's full-size all-reduce: only the local fragment is read."""

    def holds(self, param: nn.Parameter) -> bool:
        return getattr(param, "_hp_mapping", None) is not None

    def fragment(self, param: nn.Parameter) -> Optional[Fragment]:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        grad = mapping.get_lp_grad_fragment(param._index_in_param_group)
        address = mapping.lp_fragment_address
        return Fragment(address.start, address.numel, grad.view(-1))


def zero_layout(stage: int, group: Optional[dist.ProcessGroup], grad_scale: Callable[[], float]) -> GradientLayout:
    """The gradient layout of ZeRO ``stage`` over the data-parallel ``group``."""
    if stage == 0:
        return WholeGradients()
    return Zero12Gradients(group, grad_scale)
