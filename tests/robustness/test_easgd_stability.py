"""EASGD outside its stable range (issue 22, item 3): one rank, in this process.

Without gradients an elastic step multiplies the distance between the workers' mean and the center by
``1 - (P + 1) * lr * rho``: the moving rate ``P * lr * rho`` diverges from ``2P / (P + 1)`` (1 on one rank). A diverging
rate is refused at ``initialize``; a learning rate that takes the rate out of its documented range (below 1) warns at
that step; a center that would not be finite stops the run before the step changes anything. The rate between 1
and ``2P / (P + 1)`` exists from 2 ranks on (``test_ranks.py``).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from workers import problem

import ds_kfac
from ds_kfac import KFACConfigError

pytestmark = pytest.mark.timeout(120)

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "gradient_clipping": 0.0,
}


def _step(engine, step: int) -> None:
    x, y = problem.global_batch(step, 4)
    engine.backward(problem.loss_fn(engine(x), y))
    engine.step()


def test_a_diverging_moving_rate_is_refused_at_initialize(one_rank: None) -> None:
    """The issue's rate 50 (lr 0.1, rho 500, one rank) is refused naming rho, lr, the rate and a rho that works
    (before: non-finite parameters by step 25)."""
    with pytest.raises(KFACConfigError) as caught:
        ds_kfac.initialize(model=problem.make_model(), config={**CONFIG, "easgd": {"rho": 500}})
    assert re.fullmatch(
        r"easgd\.rho=500 with lr=0\.1 on 1 data-parallel ranks: the elastic moving rate world \* lr \* rho = "
        r"1 \* 0\.1 \* 500 = 50 makes EASGD diverge \(each elastic step multiplies the distance between the workers' "
        r"mean and the center by -99; stable below 1, documented range below 1\): use rho < 10",
        str(caught.value),
    ), caught.value


def test_a_learning_rate_out_of_range_warns_and_a_nonfinite_center_stops_the_run(one_rank: None) -> None:
    """A learning rate raised to 4 (rate 2) warns once, at the first step it is used; a NaN in the weights (a rank
    that diverged) stops the next elastic step with a RuntimeError on every rank, before the center, the weights or
    the step count change (before: the NaN spread to the center, and from it to every rank)."""
    easgd = {"rho": 0.5, "overlap": False}  # the weights are summed at the step, after the NaN is put in
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config={**CONFIG, "easgd": easgd})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(engine, 0)
        for group in engine.optimizer.param_groups:
            group["lr"] = 4.0
        _step(engine, 1)
        _step(engine, 2)
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning and "EASGD" in str(w.message)]
    assert messages == [
        "EASGD at step 1: the elastic moving rate world * lr * rho = 1 * 4 * 0.5 = 2 is outside its documented "
        "range (below 1): the elastic update diverges (stable below 1); lower easgd.rho or the learning rate"
    ]
    with torch.no_grad():
        next(engine.module.parameters())[0, 0] = float("nan")
    center = engine.easgd.center.clone()
    weights = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(RuntimeError) as stopped:
        _step(engine, 3)
    assert str(stopped.value).startswith(
        "EASGD step 3: the center would not be finite (the sum of the workers' weights is not: a rank's weights "
        "diverged or hold NaN/inf); stopped on every rank before the step changed anything. The elastic moving "
        "rate is world * lr * rho = 1 * 4 * 0.5 = 2"
    )
    assert torch.equal(engine.easgd.center, center) and center.isfinite().all()
    for before, after in zip(weights, engine.module.parameters()):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    assert engine.easgd.steps == 3 and engine.global_steps == 3
    engine.destroy()
