"""Worker for ``test_ranks.py``, under the real ``deepspeed`` launcher (2 ranks): ``ds_worker``'s scenarios run
through :func:`run`, each recording its error (``expect_error``) or its result.

* ``{"freeze": {"<rank>": [parameter names]}}``: those parameters of ``problem.make_model()`` are frozen on that rank
  only, then ``ds_kfac.initialize`` with K-FAC (``kfac``, ``ds`` overrides as in ``ds_worker``);
* otherwise an ``easgd_worker`` scenario (``easgd``, ``load``, ``steps``, ...), with the ``RuntimeWarning`` messages
  raised while it ran.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
import ds_worker  # noqa: E402
import easgd_worker  # noqa: E402
import problem  # noqa: E402

import ds_kfac  # noqa: E402


def frozen_per_rank(scenario: dict) -> dict:
    """Build the engine with this rank's parameters frozen (it is expected to raise)."""
    model = problem.make_model()
    frozen = scenario["freeze"].get(str(dist.get_rank()), [])
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    config = ds_worker.config(scenario, dist.get_world_size())
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds_kfac.initialize(model=model, model_parameters=trainable, config=config)
    return {"layers": engine.kfac.layer_names}


def easgd(scenario: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = easgd_worker.train(scenario)
    return {**result, "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}


def run(scenario: dict) -> dict:
    return ds_worker.run_with(frozen_per_rank if "freeze" in scenario else easgd, scenario)


if __name__ == "__main__":
    ds_worker.main(run)
