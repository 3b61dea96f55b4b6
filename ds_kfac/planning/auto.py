"""``"grad_worker_fraction": "auto"``: the placement ``ds_kfac.initialize`` chooses at start-up.

The choice is the recommendation ``python -m ds_kfac.plan --calibration FILE`` prints for the job (one function,
:func:`~ds_kfac.planning.predict.fastest`): the preset (comm-opt, hybrid-opt, mem-opt) with the least predicted
K-FAC time per step at the job's data-parallel world size and ``factor_reduction``, from the calibration the user
saved with ``--calibrate --save-calibration`` (``"calibration"`` in the ``"kfac"`` section). Nothing is timed at
start-up, so the same file and world size give the same choice. ZeRO stage 3 runs mem-opt only, which is chosen
without reading the file. The calibration must have measured this model's layer shapes: a prediction scales its
measured phases by this model's share of each layer's arithmetic, which means nothing for another model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from torch import nn

from ..config import KFACConfigError
from ..config.json_values import zero_stage
from .job import read_job
from .placements import FRACTIONS, plan_job
from .predict import Calibration, fastest, layer_shapes, predict_plan


@dataclass(frozen=True)
class Choice:
    """What ``"auto"`` chose, and why, for the log."""

    fraction: str
    calibration: str
    world: int
    predicted: dict[str, float] = field(default_factory=dict)
    """Each preset's predicted K-FAC seconds a step (the slowest rank's); empty at ZeRO stage 3."""
    measured_on: str = ""

    def describe(self) -> str:
        head = f"kfac.grad_worker_fraction 'auto' chose {self.fraction!r} at {self.world} data-parallel ranks"
        if not self.predicted:
            return head + " (ZeRO stage 3 runs mem-opt only; the calibration was not read)"
        each = ", ".join(f"{name} {1e3 * seconds:,.2f}" for name, seconds in self.predicted.items())
        return f"{head}: predicted K-FAC ms a step {each} (calibration {self.calibration}, {self.measured_on})"


def choose_fraction(
    config: dict[str, Any], model: nn.Module, world: int, param_groups: Optional[Sequence[Any]] = None
) -> Choice:
    """The preset ``"auto"`` stands for in DeepSpeed ``config`` (its ``"kfac"`` section in place) for ``model`` on
    ``world`` data-parallel ranks; ``param_groups`` as :func:`~ds_kfac.planning.plan_job` takes them. Raises
    :class:`~ds_kfac.KFACConfigError` naming the calibration where it cannot be read or is another model's."""
    path = config["kfac"]["calibration"]
    if zero_stage(config, "the DeepSpeed config") == 3:
        return Choice("mem-opt", path, world)
    try:
        calibration = Calibration.load(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise KFACConfigError(
            f"kfac.calibration={path!r}: cannot read a calibration there ({type(err).__name__}: {err}); save one "
            f"with 'python -m ds_kfac.plan --calibrate --save-calibration {path}' under the job's launcher"
        ) from None
    job = read_job(config, world)
    _refuse_other_model(path, calibration, layer_shapes(model, job.kfac))
    plan = plan_job(model, job, FRACTIONS, (job.kfac.factor_reduction,), param_groups)
    times = predict_plan(plan, calibration)
    best, _ = fastest(plan, times)
    predicted = {str(t.fraction): t.overhead for t in times if not t.refused}
    where = f"measured on {calibration.world} x {calibration.device}"
    return Choice(str(best.fraction), path, world, predicted, where)


def _refuse_other_model(path: str, calibration: Calibration, shapes: list[list[int]]) -> None:
    """A :class:`KFACConfigError` unless ``calibration`` measured layers of exactly ``shapes``."""
    if calibration.layers == shapes:
        return
    if not calibration.layers:
        raise KFACConfigError(
            f"kfac.calibration={path!r} does not record the layers it measured (saved by an older ds_kfac): "
            f"calibrate again with 'python -m ds_kfac.plan --calibrate --save-calibration {path}'"
        )
    there, here = Counter(map(tuple, calibration.layers)), Counter(map(tuple, shapes))
    missing, extra = sorted((here - there).elements()), sorted((there - here).elements())
    raise KFACConfigError(
        f"kfac.calibration={path!r} measured another model: (a_dim, g_dim) of this model's K-FAC layers not in it "
        f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, in it and not in this model "
        f"{extra[:4]}{' ...' if len(extra) > 4 else ''} ({len(shapes)} layers here, {len(calibration.layers)} "
        f"there); calibrate with this model's config (--model, or its bert section)"
    )
