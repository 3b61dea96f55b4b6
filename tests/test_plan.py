"""The planner (``python -m ds_kfac.plan``) against real runs: each rank's K-FAC memory (``memory_usage()`` after a
few steps, the factor reduction's buckets, the step's accumulators) and the bytes each step moves through K-FAC's
collectives (``ds_kfac.comm.STATS``), at 1, 2 and 4 ranks, ZeRO 0 and 2, comm-opt, hybrid-opt and mem-opt, every
``factor_reduction``, with and without ``eigenbasis_moments`` (one-sided blocks included).

The runs share one launch (``workers/plan_worker.py``: 4 ranks, then two 2-rank jobs, then four 1-rank jobs); the
planner itself runs in this process (BERT on the meta device).
"""

from __future__ import annotations

import json
import re
import runpy
import socket
import sys
from pathlib import Path

import launch
import pytest
import torch
from workers import ds_worker, problem

from ds_kfac import KFACPreconditioner
from ds_kfac.planning import plan_job, read_job
from ds_kfac.planning.cli import main
from ds_kfac.planning.models import bert_config, bert_on_meta

pytestmark = pytest.mark.timeout(300)

STEPS = 3
"""Step 0 updates factors and decomposes (and runs the engine's one-off check), 1 updates factors, 2 both."""
KFAC = {"factor_update_steps": 1, "inv_update_steps": 2, "damping": 0.01}
MOMENTS = {**KFAC, "eigenbasis_moments": True, "refresh_spread": False}
"""The key with every refresh at the cycle's first step: the planner's per-step bytes are those of that cadence (with
``refresh_spread``, the key's default, a cycle's refreshes and their bytes are spread over its steps)."""
TIED = {**MOMENTS, "tied_layers": "precondition", "eigenbasis_max_dim": 8}
"""``problem.TiedModel``: a tied decoder keeping an ``A`` basis only, a head a ``G`` basis only (one-sided blocks)."""
ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6}}}
CLIPPED = {**ADAMW, "gradient_clipping": 1.0}
ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO3 = {"zero_optimization": {"stage": 3}}
ALIGNED = {"zero_optimization": {"stage": 2, "parameter_alignment": True}}
"""ZeRO 2 padding each parameter to 16 bytes: in the mlp, the first weight (30 elements) moves the others."""


def scenario(model: str, ds: dict, kfac: dict, **placement: object) -> dict:
    """A ``ds_worker`` scenario of :data:`STEPS` steps, one micro-batch of 2 examples per rank and step."""
    return {"model": model, "ds": ds, "kfac": {**kfac, **placement}, "steps": STEPS, "micro": 2, "ga": 1}


MEM_OPT, HYBRID = "mem-opt", "hybrid-opt"
SCENARIOS = {
    4: [
        scenario("uniform", {}, KFAC),
        scenario("uniform", {}, KFAC, grad_worker_fraction=MEM_OPT, factor_reduction="reduce"),
        scenario("mlp", {}, {**KFAC, "eigenvalue_correction": True}, grad_worker_fraction=HYBRID),
        scenario("uniform", CLIPPED, {**MOMENTS, "symmetric_comm": True}),
        scenario("tied", ADAMW, TIED, grad_worker_fraction=MEM_OPT, factor_reduction="local"),
        scenario("uniform", ZERO2, {**KFAC, "eigenvalue_outer_product": True}),
        scenario("uniform", ZERO2, KFAC, grad_worker_fraction=MEM_OPT, factor_reduction="reduce"),
        scenario("uniform", {**ZERO2, **CLIPPED}, MOMENTS),
        scenario("tied", {**ZERO2, **ADAMW}, TIED, grad_worker_fraction=MEM_OPT, factor_reduction="reduce"),
        scenario("mlp", ZERO2, KFAC, grad_worker_fraction=HYBRID, factor_reduction="local"),
        scenario("mlp", ALIGNED, KFAC, grad_worker_fraction=MEM_OPT),
        scenario("mlp", ZERO3, KFAC, grad_worker_fraction=MEM_OPT),
        scenario("uniform", {**ZERO3, **CLIPPED}, MOMENTS, grad_worker_fraction=MEM_OPT, factor_reduction="reduce"),
    ],
    2: [
        [
            scenario("uniform", {}, KFAC),
            scenario("uniform", {**ZERO2, **ADAMW}, MOMENTS, grad_worker_fraction=MEM_OPT, factor_reduction="reduce"),
        ],
        [
            scenario("uniform", CLIPPED, MOMENTS, grad_worker_fraction=MEM_OPT),
            scenario("mlp", ZERO2, {**KFAC, "eigenvalue_outer_product": True}),
            scenario("mlp", ZERO3, KFAC, grad_worker_fraction=MEM_OPT, factor_reduction="local"),
        ],
    ],
    1: [
        [scenario("uniform", {}, {**KFAC, "eigenvalue_outer_product": True})],
        [scenario("uniform", {**ZERO2, **CLIPPED}, MOMENTS)],
        [scenario("tied", ADAMW, TIED)],
        [scenario("mlp", ZERO2, {**KFAC, "eigenvalue_correction": True})],
    ],
}
"""Per world size, the scenarios of its jobs (one job of 4 ranks, two of 2, four of 1)."""


def jobs() -> list[tuple[int, dict]]:
    """Every (world size, scenario) pair of the launch, in its order, each with its results' file names."""
    out = [(4, {**s, "files": [f"w4_0_{i}_rank{r}.pt" for r in range(4)]}) for i, s in enumerate(SCENARIOS[4])]
    for world in (2, 1):
        for job, scenarios in enumerate(SCENARIOS[world]):
            files = [[f"w{world}_{job}_{i}_rank{r}.pt" for r in range(world)] for i in range(len(scenarios))]
            out += [(world, {**s, "files": f}) for s, f in zip(scenarios, files)]
    return out


def sub_job_ports() -> dict[str, list[int]]:
    """A port for each 2-rank and each 1-rank job of the launch (``plan_worker``'s ``"ports"``), each serving its
    job's store from now on (:func:`launch.held_port`), so none can be taken before its job joins it."""
    return {"2": [launch.held_port() for _ in range(2)], "1": [launch.held_port() for _ in range(4)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, dict, list[dict]]]:
    """One launch: per scenario, its world size, the scenario and each rank's ``ds_worker`` result."""
    out = tmp_path_factory.mktemp("plan")
    ports = sub_job_ports()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"4": SCENARIOS[4], "2": SCENARIOS[2], "1": SCENARIOS[1], "ports": ports}))
    cmds, envs = launch.rank_launch(4, [str(launch.WORKERS / "plan_worker.py"), "--spec", str(spec), "--out", str(out)])
    try:
        launch.run(cmds, timeout=280, rank_envs=envs, preload=True)
    finally:
        for port in ports["2"] + ports["1"]:
            launch.release(port)
    return [(world, s, [torch.load(out / name, map_location="cpu") for name in s["files"]]) for world, s in jobs()]


def test_every_port_of_the_launch_is_bound_until_released() -> None:
    """The launch's port and its sub-jobs' (:func:`launch.held_port`) are bound from before the launch until
    released: no socket of an earlier phase can take one as its ephemeral port, as it could a port found free and
    closed again (the launch failed 1 time in 9)."""
    _, envs = launch.rank_launch(4, [str(launch.WORKERS / "plan_worker.py")])
    ports = [int(envs[0]["MASTER_PORT"]), *(port for job in sub_job_ports().values() for port in job)]
    try:
        for port in ports:
            with socket.socket() as s, pytest.raises(OSError, match="in use"):
                s.bind(("127.0.0.1", port))
    finally:
        for port in ports:
            launch.release(port)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def comparisons(world: int, s: dict, results: list[dict]) -> list[tuple[str, int, int]]:
    """(what, predicted, counted) for every rank of one run: its memory by category, buckets, and each step's bytes
    by collective kind (and ``initialize``'s)."""
    model = problem.MODELS[s["model"]]()
    job = read_job(ds_worker.config(s, world), world)
    plan = plan_job(
        model, job, [job.kfac.grad_worker_fraction], [job.kfac.factor_reduction], problem.param_groups(model)
    )
    (placement,) = plan.placements
    assert placement.refused is None, placement.refused
    assert plan.gradients.holders == results[0]["holders"]  # ZeRO's partitions, as DeepSpeed laid them out
    out = []
    for rank, (cost, got) in enumerate(zip(placement.ranks, results)):
        memory = {k: v for k, v in got["memory"].items() if k != "accumulators"}  # 0 between steps
        out += [(f"rank {rank} memory {k}", cost.memory[k], memory.get(k, 0)) for k in set(memory) | set(cost.memory)]
        out.append((f"rank {rank} buffers factor_buckets", cost.buffers["factor_buckets"], got["factor_buckets"]))
        for step, counted in enumerate(got["comm"]):
            predicted = cost.step_bytes(step, job.kfac.factor_update_steps, job.kfac.inv_update_steps)
            out += [(f"rank {rank} step {step} {k}", predicted[k], v) for k, v in counted.items()]
        out += [(f"rank {rank} start {k}", cost.start[k], v) for k, v in got["start"].items()]
    return out


def describe(world: int, s: dict) -> str:
    stage = s["ds"].get("zero_optimization", {}).get("stage", 0)
    placement = {k: v for k, v in s["kfac"].items() if k not in KFAC or v != KFAC[k]}
    return f"{world} ranks, ZeRO {stage}, {s['model']}, {placement}"


def test_planner_matches_every_rank_of_real_runs(runs: list) -> None:
    """Every number of every rank of every run exactly (the issue's target is 1%: byte counts have no rounding), and
    each run held bytes and, on several ranks, moved some."""
    for world, s, results in runs:
        rows = comparisons(world, s, results)
        wrong = [(what, predicted, counted) for what, predicted, counted in rows if predicted != counted]
        assert not wrong, f"{describe(world, s)}: (what, planner, counted): {wrong}"
        assert sum(c for what, _, c in rows if " memory " in what) > 0
        if world > 1:
            assert sum(c for what, _, c in rows if " step " in what) > 0


def test_the_runs_cover_every_category(runs: list) -> None:
    """The comparison above can fail: every memory category and collective kind the planner models was non-zero in
    some run (and ZeRO 2 split some layer, whose assembly the planner must count; ZeRO 3 sent its gradients' slices)."""
    memory, kinds = set(), set()
    for _, _, results in runs:
        for got in results:
            memory |= {k for k, v in got["memory"].items() if v}
            kinds |= {k for step in got["comm"] for k, v in step.items() if v} | {
                k for k, v in got["start"].items() if v
            }
    assert memory >= {
        "factors",
        "decompositions",
        "eigenbasis_moments",
        "eigenvalue_corrections",
        "preconditioning_cache",
    }
    assert kinds >= {"all_reduce", "reduce", "broadcast", "all_to_all"}  # ZeRO 3's gradients: all-to-alls
    assert any(any(r[0]["split"] or ()) for _, _, r in runs)


# ------------------------------------------------------------------------------------------------- in this process
def standalone_steps(model_name: str, kfac: dict, steps: int) -> tuple[torch.nn.Module, KFACPreconditioner]:
    """``steps`` steps of standalone K-FAC on one process, then the next step's forward and backward (its
    accumulators held, not yet stepped)."""
    model = problem.MODELS[model_name]()
    optimizer = problem.make_optimizer(model, kfac)
    precond = KFACPreconditioner(model, optimizer=optimizer, **kfac)
    for step in range(steps + 1):
        x, y = problem.global_batch(step, 4, model)
        optimizer.zero_grad()
        problem.loss_fn(model(x), y).backward()
        if step < steps:
            precond.step()
            optimizer.step()
    return model, precond


@pytest.mark.parametrize(
    "model_name,kfac",
    [
        ("mlp", {**KFAC, "eigenvalue_correction": True}),
        ("tied", TIED),
        ("uniform", {**KFAC, "factor_dtype": "bfloat16"}),
    ],
    ids=["eigenvalue_correction", "one_sided_moments", "bf16_factors"],
)
def test_accumulators_of_a_step_in_progress(model_name: str, kfac: dict) -> None:
    """The step's accumulators (float32 sums of bf16 factors; ``S`` in the eigenbasis), held from the first
    micro-batch until the factors are reduced, as ``memory_usage()`` counts them mid-step."""
    model, precond = standalone_steps(model_name, kfac, steps=2)
    (placement,) = plan_job(
        model, read_job({"train_micro_batch_size_per_gpu": 4, "kfac": kfac}, 1), ["comm-opt"], ["allreduce"]
    ).placements
    (cost,) = placement.ranks
    assert cost.buffers["accumulators"] == precond.memory_usage()["accumulators"] > 0


BERT_TINY = {  # examples/bert/pretrain.py's section of the CPU configs: 2 layers x 128, intermediate 512
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "kfac": {"skip_layers": ["^cls\\.", "pooler"]},
    "bert": {"model": "configs/bert/bert-tiny.json", "vocab_size": 1024, "max_seq_length": 64},
}
TINY_LAYERS = 2 * [(129, 128)] * 4 + 2 * [(129, 512), (513, 128)]
"""(a, g) of each K-FAC layer of BERT 2x128: query, key, value, attention output (a bias each), intermediate, output."""


@pytest.fixture(scope="module")
def bert_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert") / "bert_tiny.json"
    path.write_text(json.dumps(BERT_TINY))
    return path


def test_bert_on_meta_gives_the_documented_formulas(bert_tiny: Path) -> None:
    """BERT 2x128 on the meta device at 4 ranks against docs/placement.md's formulas (fp32, ``F = sum(a^2 + g^2)``):
    comm-opt holds every factor and decomposition and all-reduces ``4F`` and the ``4L`` presence flags per factor
    step; mem-opt holds each layer on one rank only and broadcasts each ``P(g)`` (``4ag``) once per step."""
    job = read_job(bert_tiny, 4)
    model, groups = bert_on_meta(bert_config(job.bert["model"], job.bert))
    assert next(model.parameters()).device.type == "meta"
    comm, mem = plan_job(model, job, ["comm-opt", "mem-opt"], ["allreduce"], groups).placements
    factors = 4 * sum(a * a + g * g for a, g in TINY_LAYERS)
    decompositions = 4 * sum(a * a + a + g * g + g for a, g in TINY_LAYERS)
    for cost in comm.ranks:
        assert (cost.memory["factors"], cost.memory["decompositions"]) == (factors, decompositions)
        assert cost.factor_step == {"all_reduce": factors + 4 * len(TINY_LAYERS)} and not cost.every_step
    assert sum(c.refresh["broadcast"] for c in comm.ranks) == decompositions  # each side once, from its decomposer
    assert sum(c.memory["factors"] for c in mem.ranks) == factors
    assert sum(c.memory["decompositions"] for c in mem.ranks) == decompositions
    assert sum(c.every_step["broadcast"] for c in mem.ranks) == 4 * sum(a * g for a, g in TINY_LAYERS)
    assert all(c.every_step["all_reduce"] == 4 for c in mem.ranks)  # the KL clip's sum
    assert max(c.memory["factors"] for c in mem.ranks) < factors / 2  # spread over the ranks


def test_the_command_prints_the_plan(
    bert_tiny: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m ds_kfac.plan`` (run as ``-m`` runs it), the config's ``bert.model``: every placement, the factors'
    bytes of comm-opt in KiB, and the job read from the JSON."""
    monkeypatch.setattr(sys, "argv", ["plan", "--deepspeed_config", str(bert_tiny), "--world", "4"])
    runpy.run_module("ds_kfac.plan", run_name="__main__")
    out = capsys.readouterr().out
    factors = 4 * sum(a * a + g * g for a, g in TINY_LAYERS)
    (row,) = [line for line in out.splitlines() if line.startswith("comm-opt (n=4) allreduce *")][:1]
    assert row.split()[6] == f"{factors / 1024:,.1f}"
    assert "micro-batch 8 x accumulation 2 x 4 ranks = 64 examples per step" in out
    for fraction in ("comm-opt (n=4)", "hybrid-opt (n=2)", "mem-opt (n=1)"):
        assert all(f"{fraction} {reduction}" in out for reduction in ("allreduce", "reduce", "local"))


MUON_ZERO2 = {
    "optimizer": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 0.008}},
    "zero_optimization": {"stage": 2},
    "kfac": {"eigenbasis_moments": True},
}
"""JSON Muon with the key at ZeRO 2, which ``ds_kfac.initialize`` refuses: the planner refuses it too."""


@pytest.mark.parametrize(
    "args,config,message",
    [
        (["--model", "bert-huge"], BERT_TINY, "neither a preset (bert-base, bert-large) nor a BertConfig JSON file"),
        ([], {k: v for k, v in BERT_TINY.items() if k != "kfac"}, 'has no "kfac" section'),
        (["--fraction", "0.3"], BERT_TINY, "grad_worker_fraction=0.3 with 4 data-parallel ranks gives 1.2"),
        (["--fraction", "half"], BERT_TINY, "kfac.grad_worker_fraction"),
        (["--world", "3", "--fraction", "hybrid-opt"], BERT_TINY, "gives 1.5 gradient workers per layer"),
        (["--fraction", "comm-opt"], {**BERT_TINY, **ZERO3}, "(4 gradient workers per layer) at ZeRO stage 3, where"),
        ([], {**BERT_TINY, "zero_optimization": {"stage": 4}}, "stage=4; DeepSpeed's stages are 0, 1, 2 and 3"),
        ([], {**BERT_TINY, "train_batch_size": 100}, "do not fit 4 ranks"),
        ([], {**BERT_TINY, "kfac": {"damping": -1}}, "kfac.damping"),
        ([], {**BERT_TINY, "bert": {}}, "--model is required"),
        ([], {**BERT_TINY, **MUON_ZERO2}, "optimizer type 'Muon' steps the model's own matrices"),
        (["--world", "0"], BERT_TINY, "--world must be a positive number of data-parallel ranks, got 0"),
        (["--world", "-2"], BERT_TINY, "--world must be a positive number of data-parallel ranks, got -2"),
        ([], "not JSON", "cannot read the DeepSpeed config"),
        ([], {**BERT_TINY, "optimizer": {"type": "Muon", "params": {}}}, "optimizer type 'Muon' with K-FAC needs"),
    ],
    ids=[
        *("preset", "no_kfac", "fraction", "fraction_name", "world", "zero3", "stage4", "batch", "kfac_key"),
        "no_model",
        *("muon", "world_0", "world_negative", "not_json", "muon_without_moments"),
    ],
)
def test_bad_input_is_named(tmp_path: Path, args: list[str], config: dict, message: str) -> None:
    """A message naming the input and the value, exit status 1 (``SystemExit`` with a string), no traceback."""
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    argv = ["--deepspeed_config", str(path), "--world", "4", *args]  # a second --world wins
    with pytest.raises(SystemExit, match=re.escape(message)) as error:
        main(argv)
    assert isinstance(error.value.code, str) and error.value.code.startswith("python -m ds_kfac.plan: ")


# A config's top level, and each section and key the planner reads, of another JSON kind: (JSON text, message).
WRONG_KINDS = {
    "list": ("[1, 2]", "the DeepSpeed config {path} must be a JSON object (keys and values), got a list: [1, 2]"),
    "number": ("3", "the DeepSpeed config {path} must be a JSON object (keys and values), got an integer: 3"),
    "float": ("2.5", "the DeepSpeed config {path} must be a JSON object (keys and values), got a number: 2.5"),
    "string": ('"ds.json"', 'the DeepSpeed config {path} must be a JSON object (keys and values), got a string: "ds'),
    "null": ("null", "the DeepSpeed config {path} must be a JSON object (keys and values), got null"),
    "kfac": ({"kfac": [1]}, "'kfac' must be a JSON object, got list: [1]"),
    "zero": ({"zero_optimization": 2}, "{path}: zero_optimization must be a JSON object (keys and values), got an"),
    "stage": ({"zero_optimization": {"stage": "2"}}, "{path}: zero_optimization.stage must be an integer, got a stri"),
    "alignment": (
        {"zero_optimization": {"parameter_alignment": "yes"}},
        "{path}: zero_optimization.parameter_alignment must be a b",
    ),
    "round_robin": (
        {"zero_optimization": {"round_robin_gradients": 1}},
        "{path}: zero_optimization.round_robin_gradients must be a b",
    ),
    "bf16": ({"bf16": True}, "{path}: bf16 must be a JSON object (keys and values), got a boolean: true"),
    "fp16": ({"fp16": {"enabled": "true"}}, '{path}: fp16.enabled must be a boolean, got a string: "true"'),
    "batch": ({"train_batch_size": "64"}, '{path}: train_batch_size must be an integer, got a string: "64"'),
    "micro": ({"train_micro_batch_size_per_gpu": 2.5}, "{path}: train_micro_batch_size_per_gpu must be an integer"),
    "accumulation": ({"gradient_accumulation_steps": [2]}, "{path}: gradient_accumulation_steps must be an integer"),
    "clipping": ({"gradient_clipping": "1.0"}, '{path}: gradient_clipping must be a number, got a string: "1.0"'),
    "optimizer": ({"optimizer": "AdamW"}, "{path}: optimizer must be a JSON object (keys and values), got a string"),
    "optimizer_type": ({"optimizer": {"type": 1}}, "{path}: optimizer.type must be a string, got an integer: 1"),
    "bert": ({"bert": ["bert-tiny"]}, "{path}: bert must be a JSON object (keys and values), got a list"),
    "bert_model": ({"bert": {"model": 3}}, "{path}: bert.model must be a string, got an integer: 3"),
    "bert_vocab": ({"bert": {"model": "bert-base", "vocab_size": "big"}}, "{path}: bert.vocab_size must be an"),
    "bert_seq": ({"bert": {"model": "bert-base", "max_seq_length": 64.5}}, "{path}: bert.max_seq_length must"),
}


@pytest.mark.parametrize("case", list(WRONG_KINDS))
def test_a_config_of_the_wrong_json_kind_is_named(tmp_path: Path, case: str) -> None:
    """A JSON list, number, string or null as the config's top level, and each section or key the planner reads of
    another kind: one line naming where it is, what it must be and what it is; exit status 1, no traceback (before:
    ``AttributeError: 'list' object has no attribute 'get'`` and other tracebacks)."""
    text, message = WRONG_KINDS[case]
    path = tmp_path / "ds.json"
    path.write_text(text if isinstance(text, str) else json.dumps({**BERT_TINY, **text}))
    with pytest.raises(SystemExit) as error:
        main(["--deepspeed_config", str(path), "--world", "4"])
    assert isinstance(error.value.code, str) and "\n" not in error.value.code
    assert error.value.code.startswith(f"python -m ds_kfac.plan: {message.format(path=path)}"), error.value.code


MODEL_FILES = {
    "list": ([1, 2], "not a BertConfig JSON (an object with hidden_size, num_hidden_layers...)"),
    "string": ("bert-tiny", "not a BertConfig JSON (an object with hidden_size, num_hidden_layers...)"),
    "key_kind": (
        {"hidden_size": "x", "num_hidden_layers": 1},
        "the model's BertConfig keys cannot build BertForPreTraining: Validation error for field 'hidden_size'",
    ),
    "heads": (
        {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 3, "intermediate_size": 32},
        "cannot build BertForPreTraining: The hidden size (16) is not a multiple of the number of attention heads (3)",
    ),
    "negative": (
        {"hidden_size": -16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32},
        "cannot build BertForPreTraining: Trying to create tensor with negative dimension -16",
    ),
}


@pytest.mark.parametrize("case", list(MODEL_FILES))
def test_a_model_file_that_builds_no_bert_is_named(tmp_path: Path, bert_tiny: Path, case: str) -> None:
    """``--model`` a JSON file whose top level is not an object, or whose keys transformers or torch refuse: one line
    (before: transformers' validation error and torch's RuntimeError as tracebacks)."""
    keys, message = MODEL_FILES[case]
    model = tmp_path / "model.json"
    model.write_text(json.dumps(keys))
    with pytest.raises(SystemExit) as error:
        main(["--deepspeed_config", str(bert_tiny), "--world", "4", "--model", str(model)])
    assert isinstance(error.value.code, str) and "\n" not in error.value.code
    assert message in error.value.code, error.value.code
