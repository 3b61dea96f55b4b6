"""One Kronecker factor: per-step accumulation and the running average.

Within an optimizer step every micro-batch adds ``(1/n) sum_r x_r x_r^T`` to
an accumulator (so memory does not grow with gradient accumulation); at the
step the mean over micro-batches is the step's factor, which (after any
cross-rank averaging) updates the running average
``F <- decay * F + (1 - decay) * F_step``, the first update setting ``F = F_step``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch


def compute_dtype(storage_dtype: torch.dtype) -> torch.dtype:
    """K-FAC arithmetic runs in float32 or better, whatever the storage dtype."""
    return torch.float64 if storage_dtype == torch.float64 else torch.float32


class KroneckerFactor:
    """Running average of ``E[x x^T]`` for one side (``A`` or ``G``) of one layer."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32) -> None:
        self.dim = dim
        self.dtype = dtype
        self.value: Optional[torch.Tensor] = None
        self._sum: Optional[torch.Tensor] = None
        self._count = 0

    def accumulate(
        self, rows: torch.Tensor, scale: Union[float, torch.Tensor] = 1.0, bias_column: bool = False
    ) -> None:
        """Add one micro-batch: ``(scale^2 / n) sum_r x_r x_r^T`` over the ``n`` rows,
        with a trailing 1 appended to each row when ``bias_column``."""
        x = rows.detach().to(compute_dtype(self.dtype))
        if bias_column:
            x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
        contribution = (x.t() @ x) * (scale * scale / x.shape[0])
        if self._sum is None:
            self._sum = contribution
        else:
            self._sum.add_(contribution)
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

    def update(self, step_value: torch.Tensor, decay: float) -> torch.Tensor:
        """Fold a step's factor into the running average; return whether it was finite.

        A non-finite step value leaves the running average unchanged; a
        non-finite running average is replaced by the new value. Both choices
        are made on the device (``torch.where``), so no host sync happens here.
        """
        new = step_value.to(compute_dtype(self.dtype))
        new_ok = torch.isfinite(new).all()
        if self.value is None:
            self.value = new.to(self.dtype)
            return new_ok
        old = self.value.to(new.dtype)
        blended = torch.where(torch.isfinite(old).all(), old.mul(decay).add_(new, alpha=1.0 - decay), new)
        self.value = torch.where(new_ok, blended, old).to(self.dtype)
        return new_ok
