"""The KL clip: scale every preconditioned gradient by ``nu = min(1, sqrt(kl_clip / (lr^2 |sum P(g) * g|)))``.

The sum runs over every layer of the model once (docs/conventions.md, "KL clip"): each rank adds the
layers it counts (:meth:`~ds_kfac.placement.roles.Roles.counts_in_kl_sum`, the layout's fragments and
:meth:`~ds_kfac.placement.gradients.GradientLayout.counts`), and the sum is completed over the
data-parallel ranks (when they hold different parts of it) and then over the model-parallel group, so
that every rank scales by the same ``nu``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed import ProcessGroup

from ..comm import all_reduce_sum_
from .gradients import GradientLayout
from .roles import RankRoles, Roles
from .work import LayerWork, blocks_of


def sums_over_data_parallel(sharded: bool, roles: RankRoles) -> bool:
    """Whether the data-parallel ranks hold different parts of the KL clip's sum, which one all-reduce of a float32
    scalar then completes: ZeRO's partitions (``sharded``), or fewer gradient workers than ranks."""
    return sharded or not roles.plan.replicated


class KLClip:
    """The KL clip of one preconditioner: where gradients lie (``layout``), who counts which layer
    (``roles``) and the group holding the other parts of the model (``model_parallel_group``)."""

    def __init__(self, layout: GradientLayout, roles: Roles, model_parallel_group: Optional[ProcessGroup]) -> None:
        self.layout = layout
        self.roles = roles
        self.model_parallel_group = model_parallel_group

    def clip(self, work: Sequence[LayerWork], kl_clip: float, lr: float) -> torch.Tensor:
        """Scale this rank's results in place by ``nu`` (computed from ``kl_clip``, the learning rate ``lr``
        and the results of every layer) and return ``nu``. Collective over the groups the sum is completed on."""
        layout, roles = self.layout, self.roles
        counted = [
            w
            for w in work
            if w.grad_worker and (layout.sharded or roles.counts_in_kl_sum(w.block)) and layout.counts(w.block)
        ]
        vg = layout.dot(
            blocks_of(counted), [w.fragments for w in counted], [w.result for w in counted], [w.grad for w in counted]
        )
        vg = self._complete_sum(vg, data_parallel=sums_over_data_parallel(layout.sharded, roles))
        scale = layout.grad_scale()
        nu = torch.sqrt(kl_clip / (lr**2 * (vg / (scale * scale)).abs())).clamp(max=1.0)
        for w in work:
            if w.result is not None:
                w.result = w.result.mul_(nu.to(w.result.dtype))
        return nu

    def _complete_sum(self, vg: torch.Tensor, data_parallel: bool) -> torch.Tensor:
        """This rank's part of the KL clip's ``sum(P(g) * g)`` summed over the data-parallel ranks (when
        they hold different parts of it) and then over the model-parallel group: the same on every rank."""
        groups = ([self.roles.group] if data_parallel else []) + (
            [self.model_parallel_group] if self.model_parallel_group is not None else []
        )
        if not groups:
            return vg
        vg = vg.to(torch.float32).reshape(1)
        for group in groups:
            all_reduce_sum_([vg], group)
        return vg[0]
