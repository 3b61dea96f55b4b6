"""The elastic update of synchronous EASGD, on the weights a base optimizer updates.

For worker ``i`` of ``P`` ranks, at a step ``t`` with ``t % period == 0`` (steps count from 0), with ``W_i`` and
the center ``C`` the values before the step, ``eta`` the step's learning rate and ``S = sum_i W_i``:

* ``W_i <- W_i - [base optimizer update] - eta * rho * (W_i - C)``;
* ``C <- C + eta * rho * (S - P * C)``.

``S`` comes from one all-reduce of all weights packed into one flat buffer. With ``overlap`` it is started as
soon as the weights of step ``t`` are final (right after step ``t - 1``, or at construction and after a load),
so it runs during step ``t``'s forward and backward; without, at step ``t``. Both sum the same buffer, so the
results are bitwise identical. ``S`` is the same on every rank, so the center stays identical everywhere.

Stability: without gradients, an elastic step multiplies the distance between the workers' mean and the center by
``1 - (P + 1) * eta * rho`` and each worker's distance from that mean by ``1 - eta * rho``, so the update diverges
when the moving rate ``P * eta * rho`` reaches ``2P / (P + 1)`` (:attr:`ElasticAverager.diverging_rate`). The
documented range is a rate below 1; :meth:`ElasticAverager.check_rate` refuses a diverging rate and warns outside
that range, and a center that would not be finite stops the run.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import data_parallel_world, start_all_reduce_sum_
from ..config import KFACConfigError
from .config import EASGDConfig

IN_RANGE, OVERSHOOTING, DIVERGING = 0, 1, 2
"""Where a moving rate ``P * eta * rho`` lies: below 1 (documented), below the diverging rate, or beyond."""


class ElasticAverager:
    """One rank's side of synchronous EASGD: the center, the weights' all-reduce, and the elastic update.

    Args:
        weights: the tensors the base optimizer updates (fp32 master copies under bf16), all of one dtype.
        params: the module's parameters they are copied to after an update (the same tensors in fp32).
        names: each parameter's name in the module (keys of :meth:`center_state_dict`).
        config: the ``"easgd"`` section.
        group: the process group of the data-parallel ranks, used by nothing else (the all-reduce may still be
            running while the engine communicates); ``None`` for a single process.
    """

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        config: EASGDConfig,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if not (len(weights) == len(params) == len(names)):
            raise ValueError(f"EASGD: {len(weights)} weights, {len(params)} parameters and {len(names)} names")
        self.weights, self.params, self.names = list(weights), list(params), list(names)
        self.rho, self.period, self.overlap = float(config.rho), int(config.period), config.overlap
        self.group = group
        self.world = data_parallel_world(group) if group is not None else 1
        self.center = self._pack()
        """``C``, flat, in the weights' dtype; identical on every rank (the engine starts from equal weights)."""
        self.steps = 0
        """Optimizer steps applied so far: the elastic update runs at ``steps % period == 0``."""
        self._sum: Optional[torch.Tensor] = None
        self._work: Optional[dist.Work] = None
        self._regime = IN_RANGE
        self._start()

    # ------------------------------------------------------------------ stability
    @property
    def diverging_rate(self) -> float:
        """The moving rate ``P * eta * rho`` from which the elastic update diverges: ``2P / (P + 1)``."""
        return 2 * self.world / (self.world + 1)

    def _rate(self, lr: float) -> str:
        return f"world * lr * rho = {self.world} * {lr:g} * {self.rho:g} = {self.world * lr * self.rho:g}"

    def check_rate(self, lr: float, step: Optional[int] = None) -> None:
        """Check the moving rate of learning rate ``lr``: at construction (``step=None``) a diverging rate raises
        :class:`KFACConfigError`; a rate outside the documented range (below 1) warns, then at every elastic step
        whose ``lr`` takes the rate further out than it was (a scheduler, a changed learning rate)."""
        rate = self.world * lr * self.rho
        regime = DIVERGING if rate >= self.diverging_rate else OVERSHOOTING if rate >= 1 else IN_RANGE
        if regime == DIVERGING and step is None:
            raise KFACConfigError(
                f"easgd.rho={self.rho:g} with lr={lr:g} on {self.world} data-parallel ranks: the elastic moving rate "
                f"{self._rate(lr)} makes EASGD diverge (each elastic step multiplies the distance between the workers' "
                f"mean and the center by {1 - (self.world + 1) * lr * self.rho:g}; stable below "
                f"{self.diverging_rate:.4g}, documented range below 1): use rho < {1 / (self.world * lr):.4g}"
            )
        if regime > self._regime:
            what = (
                f"the elastic update diverges (stable below {self.diverging_rate:.4g})"
                if regime == DIVERGING
                else "the center overshoots the workers' mean at every elastic step"
            )
            where = "at initialize" if step is None else f"at step {step}"
            warnings.warn(
                f"EASGD {where}: the elastic moving rate {self._rate(lr)} is outside its documented range (below 1): "
                f"{what}; lower easgd.rho or the learning rate",
                RuntimeWarning,
                stacklevel=3,
            )
        self._regime = regime

    # ------------------------------------------------------------------ the update
    def _due(self) -> bool:
        return self.steps % self.period == 0

    def _pack(self) -> torch.Tensor:
        """The weights in one flat buffer (a copy)."""
        return torch.cat([w.detach().reshape(-1) for w in self.weights])

    def _launch(self) -> None:
        """Start summing the packed weights over the ranks."""
        self._sum = self._pack()
        if self.world > 1:
            self._work = start_all_reduce_sum_(self._sum, self.group, "easgd_all_reduce")

    def _start(self) -> None:
        """With ``overlap``, launch the all-reduce of the step about to run when it has an elastic update."""
        if self.overlap and self._due() and self._sum is None:
            self._launch()

    def _weight_sum(self) -> torch.Tensor:
        """``S``: the launched all-reduce's result, or a blocking one now."""
        if self._sum is None:
            self._launch()
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._sum

    def _discard(self) -> None:
        """Finish and drop an in-flight all-reduce (every rank does, so they stay in step)."""
        if self._work is not None:
            self._work.wait()
        self._sum, self._work = None, None

    @torch.no_grad()
    def step(self, lr: float, local_step: Callable[[], bool]) -> None:
        """One optimizer step: ``local_step()`` runs the base optimizer on this rank's gradient and says whether
        the step was applied (not skipped for overflow); on a due step the elastic update follows, with ``lr``
        the learning rate of this step (read before the step, i.e. before any scheduler moves it)."""
        if not self._due():
            if local_step():
                self.steps += 1
                self._start()
            return
        self.check_rate(lr, self.steps)
        alpha = lr * self.rho
        total = self._weight_sum()
        center = total.sub(self.center, alpha=self.world)
        torch.add(self.center, center, alpha=alpha, out=center)  # the new center, in place of the difference
        if not torch.isfinite(center).all():  # one host sync per elastic step; S, hence this, is the same everywhere
            raise RuntimeError(
                f"EASGD step {self.steps}: the center would not be finite (the sum of the workers' weights is not: a "
                f"rank's weights diverged or hold NaN/inf); stopped on every rank before the step changed anything. "
                f"The elastic moving rate is {self._rate(lr)} (documented range: below 1)"
            )
        pull = self._pack().sub_(self.center).mul_(alpha)  # eta * rho * (W_i - C), before the step
        if not local_step():
            return  # the weights did not change: S stays valid for the next attempt
        for w, p, chunk in zip(self.weights, self.params, pull.split([w.numel() for w in self.weights])):
            w.sub_(chunk.view_as(w))
            if p is not w:
                p.copy_(w)
        self.center = center
        self._sum = None
        self.steps += 1
        self._start()

    # ------------------------------------------------------------------ the center
    def center_state_dict(self) -> dict[str, torch.Tensor]:
        """The center as ``{parameter name: tensor}`` (copies, in the weights' dtype, shaped as the parameters)."""
        chunks = self.center.split([w.numel() for w in self.weights])
        return {n: c.view_as(w).clone() for n, w, c in zip(self.names, self.weights, chunks)}

    @contextlib.contextmanager
    def center_swapped_in(self) -> Iterator[None]:
        """Put the center into the module's parameters for evaluation or export; the local weights come back
        bitwise at exit. Buffers (e.g. BatchNorm statistics) stay this rank's own."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, c in zip(self.params, self.center_state_dict().values()):
                p.copy_(c)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The center and the step count (the local weights and optimizer state are saved by the engine)."""
        return {"center": self.center.detach().cpu().clone(), "steps": self.steps, "world": self.world}

    def check_state_dict(self, state: Any, where: str) -> dict[str, Any]:
        """``state`` if it can be loaded into this run, else a ``ValueError`` naming ``where`` and the key."""
        problems = []
        if not isinstance(state, dict) or set(state) != {"center", "steps", "world"}:
            raise ValueError(f"{where}: not an EASGD state (expected keys center, steps, world)")
        center, steps, world = state["center"], state["steps"], state["world"]
        if (
            not isinstance(center, torch.Tensor)
            or center.shape != self.center.shape
            or center.dtype != self.center.dtype
        ):
            problems.append(f"center: expected a {self.center.dtype} tensor of shape {tuple(self.center.shape)}")
        elif not torch.isfinite(center).all():
            problems.append("center: not finite")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            problems.append(f"steps: expected an int >= 0, got {steps!r}")
        if world != self.world:
            problems.append(f"world: saved with {world} data-parallel ranks, this run has {self.world}")
        if problems:
            raise ValueError(f"EASGD state not loaded (nothing was changed): {where}: " + "; ".join(problems))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state checked by :meth:`check_state_dict`, after the local weights were loaded."""
        self._discard()
        self.center.copy_(state["center"])
        self.steps = state["steps"]
        self._start()

    def restart(self) -> None:
        """Start afresh from the current weights (a center equal to them, step 0): after loading weights alone."""
        self._discard()
        self.center = self._pack()
        self.steps = 0
        self._start()
