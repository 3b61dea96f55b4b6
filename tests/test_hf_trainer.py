"""``ds_kfac.hf.KFACTrainer`` (Hugging Face Trainer) on 1 CPU rank (in this process) and 2 (the real deepspeed
launcher, gloo).

The reference is the same model, data, seed and config trained through ``ds_kfac.initialize`` by hand
(``workers/hf_worker.py``): Trainer must run exactly that engine, one K-FAC step per optimizer step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import deepspeed
import launch
import pytest
import torch
from torch import nn

import ds_kfac
from ds_kfac.integration import substitute

pytestmark = pytest.mark.timeout(420)

STEPS, SAVE = 4, 2
STAGE = {1: 0, 2: 2}  # ZeRO stage of each world size's launch
MICRO, GA, CLIP, LR = 2, 2, 1.0, 0.05  # as in workers/hf_worker.py
BF16_WORLDS = {2}  # bf16 (Trainer's bf16=True, "bf16": {"enabled": "auto"}) in the 2-rank launch only
SAMPLED_WORLDS = {2}  # the sampled Fisher ("fisher": "sampled", KFACTrainer(fisher_loss="mse")) likewise
EIGENBASIS_WORLDS = {2}  # a JSON AdamW with "eigenbasis_moments": true likewise


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, list]]:
    """One launch per world size (world 1: this process): Trainer for STEPS steps (checkpoints every SAVE), Trainer resumed from
    ``checkpoint-SAVE``, and the direct ``ds_kfac.initialize`` run."""
    world = request.param
    out = tmp_path_factory.mktemp(f"hf_world{world}")
    common = {"stage": STAGE[world], "steps": STEPS, "save_steps": SAVE, "dir": str(out)}
    scenarios = {
        "trainer": {"run": "trainer", **common},
        "resumed": {"run": "trainer", "resume": SAVE, **common},
        "direct": {"run": "direct", **common},
    }
    if world in BF16_WORLDS:
        scenarios["bf16_trainer"] = {"run": "trainer", "bf16": True, **common}
        scenarios["bf16_direct"] = {"run": "direct", "bf16": True, **common}
    if world in SAMPLED_WORLDS:
        scenarios["sampled_trainer"] = {"run": "trainer", "fisher": "sampled", **common}
        scenarios["sampled_direct"] = {"run": "direct", "fisher": "sampled", **common}
    if world in EIGENBASIS_WORLDS:
        scenarios["eigenbasis_trainer"] = {"run": "trainer", "eigenbasis": True, **common}
        scenarios["eigenbasis_direct"] = {"run": "direct", "eigenbasis": True, **common}
    if world == 1:
        results = [[result] for result in _one_rank_here(list(scenarios.values()))]
    else:
        results = launch.deepspeed_run(world, out, list(scenarios.values()), worker=launch.WORKERS / "hf_worker.py")
    return world, dict(zip(scenarios, results))


def _one_rank_here(scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``hf_worker``'s scenarios on one rank in this process (as a 1-rank launch runs them, without its start-up),
    in the launcher's environment (and ``ACCELERATE_USE_DEEPSPEED``, which Trainer sets) restored afterwards."""
    from workers import hf_worker

    with pytest.MonkeyPatch.context() as env:
        for key, value in {**launch.one_rank_env(), "ACCELERATE_USE_DEEPSPEED": "false"}.items():
            env.setenv(key, value)
        ds_kfac.init_distributed()
        try:
            return [hf_worker.run(scenario) for scenario in scenarios]
        finally:
            ds_kfac.shutdown()


def test_kfac_steps_equal_trainer_global_steps(runs: tuple[int, dict]) -> None:
    """The engine Trainer trains is a KFACEngine whose K-FAC step count is Trainer's global step, in every log;
    Trainer filled the config's "auto" values, and the "kfac" section never reached DeepSpeed's config."""
    world, results = runs
    for rank in results["trainer"]:
        assert rank["engine"] == "KFACEngine"
        assert rank["kfac_steps"] == rank["global_step"] == STEPS
        assert [log["step"] for log in rank["logs"]] == list(range(1, STEPS + 1))
        assert [log["kfac/steps"] for log in rank["logs"]] == list(range(1, STEPS + 1))
        assert all(0 < log["kfac/nu"] <= 1 and log["kfac/seconds/precondition"] > 0 for log in rank["logs"])
        assert rank["filled"] == {
            "train_batch_size": MICRO * GA * world,
            "gradient_accumulation_steps": GA,
            "gradient_clipping": CLIP,
            "lr": LR,
            "kfac_in_deepspeed_config": False,
            "bf16": False,
            "dtype": "torch.float32",
        }


def test_parameters_equal_direct_initialize(runs: tuple[int, dict]) -> None:
    """Bitwise the parameters of ``ds_kfac.initialize`` driven by hand on the same micro-batches: the same
    loss scaling for accumulation, the same data per rank, K-FAC at the same steps. Ranks agree."""
    _, results = runs
    for trainer, direct in zip(results["trainer"], results["direct"]):
        assert direct["kfac_steps"] == direct["global_step"] == STEPS
        for got, want in zip(trainer["params"], direct["params"]):
            assert torch.equal(got, want)
    for rank in results["trainer"][1:]:
        for got, want in zip(rank["params"], results["trainer"][0]["params"]):
            assert torch.equal(got, want)


def test_bf16_parameters_equal_direct_initialize(runs: tuple[int, dict]) -> None:
    """Trainer's ``bf16=True`` fills ``"bf16": {"enabled": "auto"}`` and casts the float inputs to bf16: the same
    bf16 engine as ``ds_kfac.initialize`` with ``"enabled": true`` on bf16 inputs, bitwise, one K-FAC step per
    optimizer step."""
    world, results = runs
    if world not in BF16_WORLDS:
        pytest.skip("bf16 runs in the 2-rank launch only")
    for trainer, direct in zip(results["bf16_trainer"], results["bf16_direct"]):
        assert trainer["filled"]["bf16"] and trainer["filled"]["dtype"] == "torch.bfloat16"
        assert trainer["kfac_steps"] == trainer["global_step"] == direct["kfac_steps"] == STEPS
        for got, want in zip(trainer["params"], direct["params"]):
            assert torch.equal(got, want)


def test_sampled_fisher_in_compute_loss_equals_the_direct_loop(runs: tuple[int, dict]) -> None:
    """With "fisher": "sampled", KFACTrainer runs the sampled backward in compute_loss on the outputs' logits: the
    parameters equal bitwise those of a hand-driven engine calling ``engine.kfac.sample_fisher(logits, "mse")``
    before each ``engine.backward`` (the same targets: the default generator is seeded from the step and rank),
    and differ from the empirical Fisher's."""
    world, results = runs
    if world not in SAMPLED_WORLDS:
        pytest.skip("the sampled Fisher runs in the 2-rank launch only")
    for trainer, direct, empirical in zip(results["sampled_trainer"], results["sampled_direct"], results["trainer"]):
        assert trainer["kfac_steps"] == trainer["global_step"] == direct["kfac_steps"] == STEPS
        for got, want in zip(trainer["params"], direct["params"]):
            assert torch.equal(got, want)
        assert not all(torch.equal(a, b) for a, b in zip(trainer["params"], empirical["params"]))


def test_eigenbasis_moments_under_trainer_equal_the_direct_loop(runs: tuple[int, dict]) -> None:
    """A JSON AdamW with ``"eigenbasis_moments": true``: Trainer's param groups (decay / no decay) reach
    ``ds_kfac.initialize`` as ``model_parameters``, which builds ds_kfac's Adam with the K-FAC layers' groups flagged;
    the parameters equal bitwise those of the hand-driven engine, and differ from plain K-FAC's."""
    world, results = runs
    if world not in EIGENBASIS_WORLDS:
        pytest.skip("the eigenbasis moments run in the 2-rank launch only")
    for trainer, direct, plain in zip(results["eigenbasis_trainer"], results["eigenbasis_direct"], results["trainer"]):
        assert trainer["optimizer"] == "Adam" and trainer["kfac_steps"] == trainer["global_step"] == STEPS
        for got, want in zip(trainer["params"], direct["params"]):
            assert torch.equal(got, want)
        assert not all(torch.equal(a, b) for a, b in zip(trainer["params"], plain["params"]))


def test_resume_from_trainer_checkpoint_continues_bitwise(runs: tuple[int, dict]) -> None:
    """Each Trainer checkpoint holds K-FAC's state (written through ``engine.save_checkpoint``), and
    ``resume_from_checkpoint`` restores it with the weights and optimizer: the resumed run's logs (``kfac/nu``)
    and final parameters are those of the uninterrupted run."""
    _, results = runs
    for full, resumed in zip(results["trainer"], results["resumed"]):
        assert full["kfac_files"] == [f"checkpoint-{s}/global_step{s}/kfac_state.pt" for s in (SAVE, STEPS)]
        assert resumed["kfac_steps"] == resumed["global_step"] == STEPS
        # Trainer's log history resumes too: steps 1..SAVE come from the checkpoint, the rest are new.
        assert [log["kfac/nu"] for log in resumed["logs"]] == [log["kfac/nu"] for log in full["logs"]]
        for got, want in zip(resumed["params"], full["params"]):
            assert torch.equal(got, want)


def test_kfac_initialize_once_replaces_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the block the first ``deepspeed.initialize`` is ds_kfac's, which itself sees DeepSpeed's (no
    recursion); later calls and calls after the block, even one left by an exception, are DeepSpeed's."""
    original = deepspeed.initialize
    seen = []

    def fake_kfac_initialize(**kwargs):
        seen.append(deepspeed.initialize is original)
        return ("kfac engine", kwargs["config"], None, None)

    monkeypatch.setattr(substitute, "initialize", fake_kfac_initialize)
    with substitute.kfac_initialize_once() as built:
        assert deepspeed.initialize(config={"a": 1})[:2] == ("kfac engine", {"a": 1})
        assert deepspeed.initialize is original
    assert built == ["kfac engine"] and seen == [True]
    with pytest.raises(KeyError), substitute.kfac_initialize_once():
        raise KeyError("x")
    assert deepspeed.initialize is original


def test_import_ds_kfac_imports_neither_transformers_nor_accelerate() -> None:
    """Hugging Face stays optional: ``ds_kfac`` and its DeepSpeed API import without it."""
    code = (
        "import sys, ds_kfac; ds_kfac.initialize; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'accelerate'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"  # after DeepSpeed's log lines


def test_kfac_trainer_refuses_a_setup_without_kfac(one_rank: None, tmp_path: Path) -> None:
    """Without ``deepspeed=`` a ``ValueError`` (K-FAC runs inside DeepSpeed's engine); a DeepSpeed config without a
    ``"kfac"`` section warns that K-FAC is off; a bad section fails at construction, naming the key."""
    from transformers import TrainingArguments

    from ds_kfac.hf import KFACTrainer

    def trainer(**args: Any) -> KFACTrainer:
        return KFACTrainer(
            model=nn.Linear(2, 1), args=TrainingArguments(output_dir=str(tmp_path), report_to=[], **args)
        )

    with pytest.raises(ValueError, match="KFACTrainer runs K-FAC inside DeepSpeed"):
        trainer()
    plain = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}}
    with pytest.warns(UserWarning, match="no 'kfac' section, so K-FAC is off"):
        trainer(deepspeed=plain)
    with pytest.raises(ds_kfac.KFACConfigError, match="kfac.damping"):
        trainer(deepspeed={**plain, "kfac": {"damping": "auto"}})
