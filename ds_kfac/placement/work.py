"""One layer's trip through the second half of a step: its gradient gathered, preconditioned, clipped,
shared and written back.

:func:`gather_work` turns a :class:`~ds_kfac.placement.gradients.GradientLayout`'s gathered gradients into
one :class:`LayerWork` per layer; each later stage reads and sets its fields, and :func:`write_work` hands
the results back to the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..curvature import CurvatureBlock
from ..curvature.numerics import finite_flags
from .gradients import Fragment, GradientLayout
from .roles import Roles


@dataclass
class LayerWork:
    """A layer whose gradient this rank holds (some of it), during one step."""

    block: CurvatureBlock
    fragments: list[Optional[Fragment]]
    """This rank's fragments of the layer's reduced gradient (``None`` where it holds none of a parameter's)."""
    grad: Optional[torch.Tensor]
    """The whole gradient matrix where this rank preconditions the layer (else possibly ``None``)."""
    grad_worker: bool
    """Whether this rank preconditions the layer."""
    result: Optional[torch.Tensor] = None
    """The preconditioned (then clipped, then shared) gradient matrix; ``None`` until this rank has one."""


def gather_work(layout: GradientLayout, blocks: Sequence[CurvatureBlock], roles: Roles) -> list[LayerWork]:
    """The layers whose gradient this rank holds, their gradients gathered where it preconditions them
    (collective where the layout moves fragments)."""
    chosen, grads, fragments = layout.gather(blocks, roles.grad_workers)
    return [LayerWork(b, f, g, roles.is_grad_worker(b)) for b, g, f in zip(chosen, grads, fragments)]


def blocks_of(work: Sequence[LayerWork]) -> list[CurvatureBlock]:
    return [w.block for w in work]


def write_work(layout: GradientLayout, work: Sequence[LayerWork]) -> None:
    """Write every layer's result into the fragments this rank holds."""
    layout.write(blocks_of(work), [w.fragments for w in work], [w.result for w in work])


def all_finite_fragments(work: Sequence[LayerWork]) -> bool:
    """Whether every fragment of the layers' gradients this rank holds is finite (one host sync for all of them).
    Where the gradients are replicated (standalone, DDP) every rank answers the same."""
    return all(finite_flags([f.flat() for w in work for f in w.fragments if f is not None]))
