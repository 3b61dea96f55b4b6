"""Faults that involve several ranks (issue 22, items 3, 5 and 6): one launch of the real ``deepspeed`` launcher on
2 CPU ranks (``ranks_worker.py``, shared with test_easgd.py: see conftest.py), after a one-rank EASGD checkpoint is
saved in this process.

* an EASGD checkpoint of world size 1 resumed at 2: rank 1, which has no file, says the checkpoint's world size
  (before: "no easgd_rank1.pt (saved without EASGD?)");
* parameters frozen differently on the two ranks: ``initialize`` raises on every rank naming the layers (before:
  one rank died with signal 6 at the first factor collective, the other saw "connection reset by peer");
* an EASGD moving rate ``P * lr * rho`` between 1 and ``2P / (P + 1)`` (4/3 on 2 ranks) warns and trains; at 4/3
  and above it is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import launch
import pytest
from workers import problem

import ds_kfac

pytestmark = pytest.mark.timeout(300)

EASGD = {"ds": {"gradient_clipping": 0.0}, "steps": 2, "micro": 2, "ga": 1}
FROZEN = {"1": ["2.bias", "4.weight"]}  # rank 1 only: layer 2 loses its bias column in A, layer 4 is skipped


def _save_at_world_size_one(path: Path) -> None:
    """An EASGD checkpoint (tag ``ckpt``, 1 step) of a one-rank job, in this process."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in launch.one_rank_env().items():
            env.setenv(key, value)
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = ds_kfac.initialize(model=problem.make_model(), config={**config, "easgd": {"rho": 0.5}})
        x, y = problem.global_batch(0, 2)
        engine.backward(problem.loss_fn(engine(x), y))
        engine.step()
        engine.save_checkpoint(str(path), tag="ckpt")
        engine.destroy()
        ds_kfac.shutdown()


def job_scenarios(out: Path) -> dict[str, dict[str, Any]]:
    """This module's part of conftest.py's EASGD job (``ranks_worker.py`` runs it), after the one-rank checkpoint
    it resumes is saved under ``out``."""
    _save_at_world_size_one(out / "easgd1")
    return {
        "resumed at world size 2": {**EASGD, "easgd": {"rho": 0.5}, "load": str(out / "easgd1"), "expect_error": 1},
        "overshooting": {**EASGD, "easgd": {"rho": 6.0}},  # 2 * 0.1 * 6 = 1.2
        "diverging": {**EASGD, "easgd": {"rho": 7.0}, "expect_error": 1},  # 2 * 0.1 * 7 = 1.4 >= 4/3
        "frozen per rank": {"freeze": FROZEN, "expect_error": 1},
    }


@pytest.fixture(scope="module")
def runs(easgd_job: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    return easgd_job[__name__]


def test_an_easgd_checkpoint_resumed_at_another_world_size_names_it(runs) -> None:
    """issue 22, item 5: every rank refuses before DeepSpeed loads anything; rank 1 names the saved world size."""
    rank0, rank1 = (r["error"] for r in runs["resumed at world size 2"])
    assert "world: saved with 1 data-parallel ranks, this run has 2" in rank0
    assert rank1.startswith("ValueError: EASGD state not loaded (nothing was changed): no ")
    assert rank1.endswith(
        "easgd_rank1.pt: the checkpoint was saved at world size 1 (one easgd_rank<r>.pt per rank) and this run has "
        "2 data-parallel ranks; each rank's weights are its own and cannot be redistributed: resume at world size "
        "1, or pass load_optimizer_states=False to restart EASGD from rank 0's weights"
    ), rank1
    assert "saved without EASGD" not in rank1


def test_an_easgd_moving_rate_between_one_and_its_limit_warns_and_beyond_is_refused(runs) -> None:
    """issue 22, item 3, at 2 ranks: rate 1.2 warns once at initialize (not again at each step) and trains with a
    finite center; rate 1.4 (limit 4/3) is refused on every rank."""
    for rank in runs["overshooting"]:
        assert rank["warnings"] == [
            "EASGD at initialize: the elastic moving rate world * lr * rho = 2 * 0.1 * 6 = 1.2 is outside its "
            "documented range (below 1): the center overshoots the workers' mean at every elastic step; lower "
            "easgd.rho or the learning rate"
        ]
        assert all(c.isfinite().all() for c in rank["center"].values())
    for rank in runs["diverging"]:
        assert rank["error"].startswith(
            "KFACConfigError: easgd.rho=7 with lr=0.1 on 2 data-parallel ranks: the elastic moving rate world * lr * "
            "rho = 2 * 0.1 * 7 = 1.4 makes EASGD diverge"
        ), rank["error"]
        assert "stable below 1.333, documented range below 1): use rho < 5" in rank["error"]


def test_parameters_frozen_differently_on_different_ranks_are_refused_naming_the_layers(runs) -> None:
    """issue 22, item 6: ``initialize`` raises the same error on both ranks, naming both layers and what differs."""
    errors = [r["error"] for r in runs["frozen per rank"]]
    assert errors[0] == errors[1]
    assert errors[0] == (
        "ValueError: K-FAC's layers differ between the data-parallel ranks, whose models must be replicas (parameters "
        "frozen differently on different ranks?): '2': A of size 5 on some ranks, 6 on others (its bias frozen on "
        "some?); '4': registered on some ranks, skipped on others (its weight frozen on some?)"
    )
