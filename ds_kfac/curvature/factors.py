"""Per-layer running statistics: Kronecker factors (and eigenvalue corrections, :mod:`.correction`).

Within an optimizer step every micro-batch adds ``(1/n) sum_r x_r x_r^T`` to
an accumulator (so memory does not grow with gradient accumulation); at the
step the mean over micro-batches is the step's factor, which (after any
cross-rank averaging) updates the running average
``F <- decay * F + (1 - decay) * F_step``, the first update setting ``F = F_step``. A Kronecker factor
without curvature of its own (a dead layer's ``A = 0``; ``A``'s bias entry alone counts as none) is replaced by the
next step's instead of averaged with it, and with relative damping decomposed as zero.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .numerics import compute_dtype, curvature_floor


class RunningAverage:
    """A per-layer statistic of shape ``shape``: per-step accumulation of micro-batch statistics and the running
    average ``F <- decay * F + (1 - decay) * F_step`` (the first update setting ``F = F_step``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
        self.shape = shape
        self.dtype = dtype
        self.value: Optional[torch.Tensor] = None
        self._sum: Optional[torch.Tensor] = None
        self._count = 0

    def add(self, statistic: torch.Tensor) -> None:
        """Add one micro-batch's statistic (the first is adopted, not copied)."""
        if self._sum is None:
            self._sum = statistic
        else:
            self._sum.add_(statistic)
        self._count += 1

    def nbytes(self) -> tuple[int, int]:
        """Bytes of the running average and of this step's accumulator."""
        return tuple(0 if t is None else t.numel() * t.element_size() for t in (self.value, self._sum))

    @property
    def pending(self) -> int:
        """Micro-batches accumulated since the last :meth:`take_step`."""
        return self._count

    def take_step(self) -> Optional[torch.Tensor]:
        """The mean over this step's micro-batches (``None`` if there were none); resets the accumulator."""
        if self._sum is None:
            return None
        mean = self._sum.div_(self._count)
        self.discard_step()
        return mean

    def discard_step(self) -> None:
        """Drop this step's statistics (e.g. a step skipped for fp16 overflow)."""
        self._sum, self._count = None, 0

    def blend(self, step_value: torch.Tensor, decay: float) -> torch.Tensor:
        """The running average with a step's statistic folded in, as a new tensor in the storage dtype.

        The running average itself is not touched (a step can still be undone by
        restoring the reference, see :meth:`KFACPreconditioner.snapshot`): one
        ``lerp`` reads both and writes the result. ``step_value`` may be a view
        into a communication buffer; the result never is."""
        new = step_value.to(compute_dtype(self.dtype))
        if self.value is None:
            return new.to(self.dtype, copy=True)
        return torch.lerp(self.value.to(new.dtype), new, 1.0 - decay).to(self.dtype)


class KroneckerFactor(RunningAverage):
    """Running average of ``E[x x^T]`` for one side (``A`` or ``G``) of one layer; ``bias_column``: its last row
    and column are a bias's (``A`` of a layer with a bias)."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, bias_column: bool = False) -> None:
        super().__init__((dim, dim), dtype)
        self.dim = dim
        self.bias_column = bias_column

    def curvature(self, value: torch.Tensor) -> torch.Tensor:
        """The mean curvature of ``value`` (this factor's shape) over its input rows, a device tensor: ``tr F / dim``
        without the bias row, whose entry is 1 whatever the input, so a layer whose inputs were all zero has none."""
        diagonal = value.diagonal()
        if self.bias_column:
            diagonal = diagonal[:-1]
        return diagonal.to(compute_dtype(value.dtype)).mean()

    def uncurved(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whether ``value`` has no curvature of its own in ``dtype``: :meth:`curvature` below
        :func:`~.numerics.curvature_floor` (a device bool: no host sync)."""
        return self.curvature(value) < curvature_floor(dtype)

    def blend(self, step_value: torch.Tensor, decay: float) -> torch.Tensor:
        """As :meth:`RunningAverage.blend`, except that a running factor without curvature (:meth:`uncurved`: a
        layer whose input or output gradient was 0) is replaced by the step's factor, as a first update is.
        Averaged in, a zero factor would shrink the next ones by ``1 - decay`` and scale ``P(g)`` up by
        ``1 / (1 - decay)`` (20x at 0.95), relative damping or not."""
        blended = super().blend(step_value, decay)
        if self.value is None:
            return blended
        dtype = compute_dtype(self.dtype)
        return torch.where(self.uncurved(self.value, dtype), step_value.to(dtype), blended.to(dtype)).to(self.dtype)

    def decomposed(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``value`` as relative damping decomposes it in ``dtype``: zero where it is :meth:`uncurved`, so that the
        block has no usable curvature (:meth:`~.decomposition.Decomposition.uncurved`) and passes its gradient
        through until a decomposition finds curvature. Its bias entry alone would give ``A`` a mean eigenvalue of
        ``1 / dim`` and leave the weights' directions damped by that alone once the input comes alive."""
        return torch.where(self.uncurved(value, dtype), 0.0, value)

    def accumulate(self, rows: torch.Tensor, scale: Union[float, torch.Tensor] = 1.0) -> None:
        """Add one micro-batch: ``(scale^2 / n) sum_r x_r x_r^T`` over the ``n`` rows (``G``, at the backward)."""
        x = rows.detach().to(compute_dtype(self.dtype))
        if self._sum is None:
            self._sum = x.new_zeros(self.dim, self.dim)
        _add_outer(self._sum, x, scale, bias_column=False)
        self._count += 1

    def statistic(self, rows: torch.Tensor, bias_column: bool = False) -> torch.Tensor:
        """One micro-batch's ``(1/n) sum_r x_r x_r^T`` as a new matrix, to :meth:`add` later (``A`` is
        computed at the forward pass but counts only once its output gets a backward)."""
        x = rows.detach().to(compute_dtype(self.dtype))
        return _add_outer(x.new_zeros(self.dim, self.dim), x, 1.0, bias_column)


def _add_outer(
    target: torch.Tensor, x: torch.Tensor, scale: Union[float, torch.Tensor], bias_column: bool
) -> torch.Tensor:
    """``target += (scale^2 / n) [x;1]^T [x;1]`` for ``n`` rows ``x``: one fused GEMM (``addmm_``), the bias
    column added in block form (``[[x^T x, x^T 1], [1^T x, n]]``), so the rows are never copied wider."""
    n, d = x.shape
    weight = scale * scale / n
    if isinstance(weight, torch.Tensor):  # a device loss scale: no host sync to read it
        target[:d, :d].add_((x.t() @ x).mul_(weight))
    else:
        target[:d, :d].addmm_(x.t(), x, alpha=weight)
    if bias_column:
        column = x.sum(dim=0).mul_(weight)
        target[:d, d].add_(column)
        target[d, :d].add_(column)
        target[d, d].add_(n * weight)
    return target
