"""Placement modes: the plan (determinism, balance) and distributed runs at world sizes 1, 2 and 4.

Distributed runs use standalone K-FAC under DDP (``workers/ddp_worker.py``, torchrun, gloo; world size 1 on one rank
in this process) and are compared with single-process references on the concatenated global batch.
"""

from __future__ import annotations

import launch
import pytest
import torch
from test_deepspeed import FP32_TOL_BATCHNORM
from workers import ddp_worker, problem

import ds_kfac
from ds_kfac import KFACConfigError, KFACPreconditioner
from ds_kfac.comm import OrderedBuckets
from ds_kfac.placement import LayerShape, PlacementPlan, RankRoles, lpt, workers_per_layer
from ds_kfac.preconditioning.spread import SpreadRefresh

pytestmark = pytest.mark.timeout(420)

# Full eigendecompositions (single-process references to 1e-5; docs/conventions.md, "Refreshing a basis").
KFAC = {"kl_clip": 0.01, "damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2, "basis_update": "eigh"}
MEM_OPT_REDUCE = {"grad_worker_fraction": "mem-opt", "factor_reduction": "reduce"}
EIGENBASIS_MOMENTS = {**KFAC, "eigenbasis_moments": True, "kl_clip": None, "basis_update": "exact"}
STEPS, PER_RANK = 5, 2
# fp32: factors summed in another order than the single process's, then eigendecomposed;
# over 5 steps that moves small parameters by up to ~2e-6. BatchNorm over 2 rows per rank amplifies float32 rounding
# (FP32_TOL_BATCHNORM): one process is 1.4e-5 from float64 after 5 steps at 4 ranks' rows, 4 ranks 2.2e-5 from it.
FP32_TOL = dict(rtol=1e-5, atol=5e-6)


# ----------------------------------------------------------------------------- plans
def resnet50_layers() -> list[LayerShape]:
    """The Conv2d/Linear factor sizes of ResNet-50 (no conv biases; fc with bias)."""
    layers = [LayerShape("conv1", 3 * 7 * 7, 64)]
    cin = 64
    for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for b in range(blocks):
            name = f"layer{stage + 1}.{b}"
            layers += [
                LayerShape(f"{name}.conv1", cin, width),
                LayerShape(f"{name}.conv2", width * 9, width),
                LayerShape(f"{name}.conv3", width, 4 * width),
            ]
            if b == 0:
                layers.append(LayerShape(f"{name}.downsample", cin, 4 * width))
            cin = 4 * width
    return layers + [LayerShape("fc", 2048 + 1, 1000)]


def bert_large_layers() -> list[LayerShape]:
    layers = []
    for i in range(24):
        p = f"encoder.layer.{i}"
        layers += [LayerShape(f"{p}.attention.{m}", 1025, 1024) for m in ("query", "key", "value", "output")]
        layers += [LayerShape(f"{p}.intermediate", 1025, 4096), LayerShape(f"{p}.output", 4097, 1024)]
    return layers + [LayerShape("pooler", 1025, 1024)]


@pytest.mark.parametrize("layers", [resnet50_layers, bert_large_layers], ids=["resnet50", "bert-large"])
@pytest.mark.parametrize("assignment", ["compute", "memory"])
@pytest.mark.parametrize("world,fraction", [(8, "comm-opt"), (16, "comm-opt"), (16, 0.25), (64, "mem-opt")])
def test_plan_is_deterministic_and_balanced(layers, assignment: str, world: int, fraction) -> None:
    shapes = layers()
    plan = PlacementPlan(shapes, world, fraction, assignment)
    again = PlacementPlan(list(shapes), world, fraction, assignment)
    assert plan.layers == again.layers and plan.rank_loads == again.rank_loads
    power = 3 if assignment == "compute" else 2
    items = [float(d) ** power for s in shapes for d in (s.a_dim, s.g_dim)]
    mean = sum(items) / world
    # Greedy LPT is within 4/3 of the optimum, which is at least max(largest item, mean load).
    assert max(plan.rank_loads) <= 4 / 3 * max(max(items), mean) * (1 + 1e-9)
    print(f"\n{layers.__name__} world {world} {fraction} {assignment}: makespan max/mean {plan.makespan_ratio():.3f}")
    for p in plan.layers.values():
        assert p.a_worker in p.grad_workers and p.g_worker in p.grad_workers
        assert len(p.grad_workers) == plan.n


def test_bert_plan_is_nearly_perfectly_balanced() -> None:
    plan = PlacementPlan(bert_large_layers(), 8, "comm-opt", "compute")
    assert plan.makespan_ratio() < 1.02


def test_lpt_assigns_largest_first_to_least_loaded() -> None:
    assignment, loads = lpt([5, 4, 3, 3, 3], 2)
    assert assignment == [0, 1, 1, 0, 1] and loads == [8.0, 10.0]


def test_fraction_must_give_whole_worker_count() -> None:
    assert [workers_per_layer(f, 4) for f in ("comm-opt", "hybrid-opt", "mem-opt", 0.25, 0.5, 1.0)] == [
        4,
        2,
        1,
        1,
        2,
        4,
    ]
    with pytest.raises(KFACConfigError, match=r"grad_worker_fraction=0.3 with 4 .*1.2 gradient workers.*1/4, 2/4, 4/4"):
        workers_per_layer(0.3, 4)
    with pytest.raises(KFACConfigError, match="hybrid-opt"):
        workers_per_layer("hybrid-opt", 3)


@pytest.mark.parametrize("fraction,n", [("mem-opt", 1), (0.25, 2), ("hybrid-opt", 4)])
def test_owner_plan_uses_the_columns_of_the_partition_holders(fraction, n: int) -> None:
    """ZeRO 1/2 at 8 ranks: BERT-large layers laid out in 8 contiguous partitions (some split
    across two); each layer's gradient workers are the columns of its holders, its
    decompositions stay among them, and the plan is deterministic."""
    shapes = bert_large_layers()
    sizes = [s.a_dim * s.g_dim for s in shapes]
    bounds = [sum(sizes) * r / 8 for r in range(9)]
    holders, offset = {}, 0
    for s, size in zip(shapes, sizes):
        holders[s.name] = tuple(r for r in range(8) if offset < bounds[r + 1] and offset + size > bounds[r])
        offset += size
    assert any(len(h) > 1 for h in holders.values())
    plan = PlacementPlan(shapes, 8, fraction, "compute", holders=holders)
    assert plan.layers == PlacementPlan(shapes, 8, fraction, "compute", holders=dict(holders)).layers
    for s in shapes:
        p = plan.layers[s.name]
        columns = {r // n for r in holders[s.name]}
        assert set(p.grad_workers) == {c * n + j for c in columns for j in range(n)}
        assert {p.a_worker, p.g_worker} <= set(p.grad_workers)
    if n == 1:
        assert all(plan.layers[name].grad_workers == h for name, h in holders.items())


def test_ordered_buckets_keep_units_whole_and_group_destinations() -> None:
    """Units fill buckets in the given order up to the cap without straddling two; within a
    bucket each destination's tensors form one contiguous slice (one reduce each)."""
    units = [[4, 4], [9, 1], [2, 2], [20, 5]]
    dsts = [[1, 0], [0, 1], [1, 1], [0, 0]]
    b = OrderedBuckets(units, torch.float32, torch.device("cpu"), None, bucket_bytes=4 * 20, dsts=dsts)
    assert [bucket.units for bucket in b.buckets] == [[0, 1], [2], [3]]
    assert [bucket.segments for bucket in b.buckets] == [
        [(0, 0, 13), (1, 13, 18)],  # dst 0: unit 0's G (4) then unit 1's A (9); dst 1: unit 0's A, unit 1's G
        [(1, 0, 4)],
        [(0, 0, 25)],
    ]
    plain = OrderedBuckets(units, torch.float32, torch.device("cpu"), None, bucket_bytes=4 * 30)
    assert [bucket.units for bucket in plain.buckets] == [[0, 1, 2], [3]]
    assert [bucket.segments for bucket in plain.buckets] == [[(None, 0, 22)], [(None, 0, 25)]]


# ------------------------------------------------------------------ distributed runs
def reference(
    world: int,
    steps: int = STEPS,
    owners: dict[str, int] | None = None,
    model: str = "mlp",
    per_rank: int = PER_RANK,
    **keys,
) -> tuple[list[torch.Tensor], KFACPreconditioner]:
    """Parameters after each step of a single process on the global batch.

    With ``owners`` (``local``): each layer's factors come only from its owner's rows,
    gathered by one backward pass per rank-sized slice with only that rank's layers collecting.
    With the sampled Fisher or BatchNorm, also one pass per rank-sized slice: each samples with
    that rank's generator, and BatchNorm normalizes each rank's rows on their own, as under DDP.
    """
    model = problem.MODELS[model]()
    config = {**KFAC, **keys}
    opt = problem.make_optimizer(model, config)
    per_rank_passes = bool(owners) or config.get("fisher") == "sampled" or problem.has_batchnorm(model)
    kfac = KFACPreconditioner(model, optimizer=opt, accumulation_steps=world if per_rank_passes else 1, **config)
    if kfac.config.refresh_spread:  # the slots of the world's plan (each decomposing rank's sides balanced)
        kfac.schedule.spread = SpreadRefresh(kfac.blocks, RankRoles(kfac.blocks, kfac.config, world, 0).decomposer)
    current = {"rank": 0}
    if owners:
        kfac.distributor.collects = lambda block: owners[block.name] == current["rank"]
    history = []
    for step in range(steps):
        x, y = problem.global_batch(step, per_rank * world)
        opt.zero_grad()
        if per_rank_passes:
            for r in range(world):
                current["rank"] = r
                rows = slice(r * per_rank, (r + 1) * per_rank)
                out = model(x[rows])
                kfac.sample_fisher(out, "mse", generator=problem.sampling_generator(step, 0, r))
                (problem.loss_fn(out, y[rows]) / world).backward()
        else:
            problem.loss_fn(model(x), y).backward()
        kfac.step()
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    return history, kfac


def fractions(world: int) -> list[float]:
    return [d / world for d in range(1, world + 1) if world % d == 0]


def scenarios(world: int) -> dict[str, dict]:
    runs = {
        f"fraction{f:g}-{reduction}": {"kfac": {**KFAC, "grad_worker_fraction": f, "factor_reduction": reduction}}
        for f in fractions(world)
        for reduction in ("allreduce", "reduce")
    }
    runs["mem-opt-local"] = {"kfac": {**KFAC, "grad_worker_fraction": "mem-opt", "factor_reduction": "local"}}
    runs["comm-opt-local"] = {"kfac": {**KFAC, "factor_reduction": "local"}}
    runs["comm-opt-reduce-symmetric"] = {"kfac": {**KFAC, "factor_reduction": "reduce", "symmetric_comm": True}}
    runs["mem-opt-inverse"] = {"kfac": {**KFAC, "grad_worker_fraction": "mem-opt", "compute_method": "inverse"}}
    # Decompositions in the background, shared within columns when installed a step later.
    runs["mem-opt-async"] = {"kfac": {**KFAC, "grad_worker_fraction": "mem-opt", "async_decompositions": True}}
    runs["hybrid-eigen-outer"] = {
        "kfac": {**KFAC, "grad_worker_fraction": min(1.0, 2 / world), "eigenvalue_outer_product": True}
    }
    runs["adaptive-hybrid-reduce"] = {
        "kfac": {
            **KFAC,
            "inv_update_steps": "adaptive",
            "grad_worker_fraction": min(1.0, 2 / world),
            "factor_reduction": "reduce",
        }
    }
    # Small buckets (one layer each) to see every bucket's reduction start during backward.
    runs["overlap-small-buckets"] = {"kfac": {**KFAC, "bucket_bytes": 256}}
    runs["no-overlap-small-buckets"] = {"kfac": {**KFAC, "bucket_bytes": 256, "overlap_factor_comm": False}}
    runs["overlap-shared-layer-reduce"] = {
        "kfac": {**KFAC, "bucket_bytes": 256, "factor_reduction": "reduce"},
        "model": "shared",
    }
    # Eigenvalue correction: every rank projects its examples' gradients, so the bases go to every rank; S is
    # all-reduced beside factors reduced to their decomposing ranks.
    runs["mem-opt-corrected-reduce"] = {"kfac": {**KFAC, **MEM_OPT_REDUCE, "eigenvalue_correction": True}}
    # The curvature options under DDP: unit-wise BatchNorm blocks (each rank normalizes its own rows) on every rank,
    # or decomposed by one rank with their F reduced to it; the sampled Fisher (each rank samples with its own
    # generator) likewise; the eigenvalue correction with 2 gradient workers per layer, S all-reduced.
    batchnorm = {**KFAC, "batchnorm": "unit-wise"}
    runs["batchnorm-comm-opt"] = {"kfac": batchnorm, "model": "batchnorm"}
    runs["batchnorm-mem-opt-reduce"] = {"kfac": {**batchnorm, **MEM_OPT_REDUCE}, "model": "batchnorm"}
    # Refreshes spread over a cycle of 3 steps, each side refreshed in its slot by its decomposing rank and shared
    # with the layer's holders (full eigendecompositions: compared to the reference); and warm-started bases
    # (the default), whose ranks must agree bit for bit though another world size's rounding picks another start.
    runs["mem-opt-reduce-spread"] = {"kfac": {**KFAC, **MEM_OPT_REDUCE, "refresh_spread": True, "inv_update_steps": 3}}
    runs["hybrid-subspace-spread"] = {
        "kfac": {
            **KFAC,
            "grad_worker_fraction": min(1.0, 2 / world),
            "basis_update": "subspace",
            "refresh_spread": True,
            "inv_update_steps": 3,
        }
    }
    runs["sampled-comm-opt"] = {"kfac": {**KFAC, "fisher": "sampled"}}
    runs["sampled-mem-opt-reduce"] = {"kfac": {**KFAC, "fisher": "sampled", **MEM_OPT_REDUCE}}
    runs["hybrid-corrected"] = {
        "kfac": {**KFAC, "grad_worker_fraction": min(1.0, 2 / world), "eigenvalue_correction": True}
    }
    # AdamW's moments in K-FAC's eigenbasis, kept on the ranks that precondition each layer: 2 of them per layer
    # (hybrid at 4 ranks), or one with the factors reduced to it.
    runs["hybrid-eigenbasis-moments"] = {"kfac": {**EIGENBASIS_MOMENTS, "grad_worker_fraction": min(1.0, 2 / world)}}
    runs["mem-opt-eigenbasis-moments-reduce"] = {"kfac": {**EIGENBASIS_MOMENTS, **MEM_OPT_REDUCE}}
    runs["uniform-comm-opt-allreduce"] = {"kfac": KFAC, "model": "uniform"}
    runs["uniform-mem-opt-reduce"] = {"kfac": {**KFAC, **MEM_OPT_REDUCE}, "model": "uniform"}
    for run in runs.values():
        run.update(steps=STEPS, per_rank=PER_RANK)
    # S is defined in an eigenbasis, which eigh picks freely within a degenerate (null) space: with fewer global rows
    # than A's size (7) the ranks and the single process would pick different ones. 4 rows per rank.
    # The same for the moments, which AdamW's division by sqrt(v) makes sensitive to a null space's basis.
    for name in (
        "mem-opt-corrected-reduce",
        "hybrid-corrected",
        "hybrid-eigenbasis-moments",
        "mem-opt-eigenbasis-moments-reduce",
    ):
        runs[name]["per_rank"] = 4
    return runs


# Two forward/backward passes in one step with accumulation_steps=1 (test_a_pass_after_the_factors_were_sent_is_an_error);
# it runs last in the 2-rank launch, after the scenarios of world_runs.
TWO_PASSES = {"kfac": KFAC, "steps": 1, "per_rank": PER_RANK, "passes": 2, "expect_error": True}


def in_process(runs: list[dict]) -> list[list[dict]]:
    """``workers/ddp_worker.py``'s scenarios on one rank in this process (as a 1-rank torchrun runs them, without its
    start-up): the launcher's environment, restored afterwards (one intra-op thread, as the worker sets, is the
    session's: conftest.py)."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in launch.one_rank_env().items():
            env.setenv(key, value)
        torch.distributed.init_process_group("gloo")
        try:
            return [[ddp_worker.run(run)] for run in runs]
        finally:
            ds_kfac.shutdown()


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    """The 2-rank torchrun: world_runs's scenarios, then :data:`TWO_PASSES`."""
    return launch.torchrun(2, tmp_path_factory.mktemp("world2"), [*scenarios(2).values(), TWO_PASSES])


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda w: f"world{w}")
def world_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    world = request.param
    runs = scenarios(world)
    if world == 1:
        results = in_process(list(runs.values()))
    elif world == 2:
        results = request.getfixturevalue("two_rank_launch")[: len(runs)]
    else:
        results = launch.torchrun(world, tmp_path_factory.mktemp(f"world{world}"), list(runs.values()))
    return world, dict(zip(runs, results))


def test_every_mode_matches_single_process_and_ranks_agree_every_step(world_runs) -> None:
    world, runs = world_runs
    for name, results in runs.items():
        if name.startswith("uniform") or "local" in name:
            continue
        if "adaptive" in name:
            schedules = [r["refresh"] for r in results]
            assert all(s == schedules[0] for s in schedules), "adaptive intervals differ across ranks"
        for step in range(STEPS):
            for r in range(1, world):
                assert torch.equal(results[0]["params"][step], results[r]["params"][step]), (name, step, r)
        if "subspace" in name:  # a warm start picked by this world size's rounding: the ranks' agreement only
            continue
        scenario = scenarios(world)[name]
        expected, _ = reference(
            world, model=scenario.get("model", "mlp"), per_rank=scenario["per_rank"], **scenario["kfac"]
        )
        for step in range(STEPS):
            tolerance = FP32_TOL_BATCHNORM if scenario.get("model") == "batchnorm" else FP32_TOL
            torch.testing.assert_close(
                results[0]["params"][step], expected[step], **tolerance, msg=f"{name} step {step}"
            )


def test_factor_reduction_overlaps_backward_with_the_same_result(world_runs) -> None:
    """Every layer's bucket starts its reduction during backward (also the layer run twice per
    forward, which must wait for its second backward), and the parameters are bit-identical to
    reducing everything at the step."""
    world, runs = world_runs
    for name in ("overlap-small-buckets", "overlap-shared-layer-reduce"):
        for r in runs[name]:
            assert r["buckets"] == (3 if world > 1 else 0), name
            assert r["overlapped"] == STEPS * r["buckets"], name
    assert all(r["overlapped"] == 0 for r in runs["no-overlap-small-buckets"])
    for with_overlap, without in zip(runs["overlap-small-buckets"], runs["no-overlap-small-buckets"]):
        for step in range(STEPS):
            assert torch.equal(with_overlap["params"][step], without["params"][step])


def test_a_pass_after_the_factors_were_sent_is_an_error(two_rank_launch) -> None:
    """Two forward/backward passes in one step with accumulation_steps=1 (:data:`TWO_PASSES`, on 2 ranks): the second
    pass's statistics would arrive after the first pass's factors were sent, so it raises, naming the layer."""
    assert len(two_rank_launch) == len(scenarios(2)) + 1
    for result in two_rank_launch[-1]:
        assert "K-FAC layer '" in result["error"] and "overlap_factor_comm" in result["error"]


@pytest.mark.parametrize("mode", ["mem-opt-local", "comm-opt-local"])
def test_local_factors_come_from_the_owner_only(world_runs, mode: str) -> None:
    world, runs = world_runs
    results = runs[mode]
    owners = {name: placement[0] for name, placement in results[0]["layers"].items()}
    expected, _ = reference(world, owners=owners, **scenarios(world)[mode]["kfac"])
    for step in range(STEPS):
        for r in range(1, world):
            assert torch.equal(results[0]["params"][step], results[r]["params"][step])
        torch.testing.assert_close(results[0]["params"][step], expected[step], **FP32_TOL)


def test_mem_opt_reduce_holds_one_world_th_of_comm_opt(world_runs) -> None:
    world, runs = world_runs
    full = runs["uniform-comm-opt-allreduce"]
    lean = runs["uniform-mem-opt-reduce"]
    for r in range(world):
        total_full = full[r]["memory"]["factors"] + full[r]["memory"]["decompositions"]
        total_lean = lean[r]["memory"]["factors"] + lean[r]["memory"]["decompositions"]
        assert total_lean / total_full == pytest.approx(1 / world, rel=1e-9)


def expected_memory(scenario: dict, results: list[dict], rank: int) -> dict[str, int]:
    """Documented bytes per rank after some steps (docs/placement.md, "memory per rank"): running factors
    where ``factor_reduction`` keeps them, decompositions on the layer's gradient workers (with the eigenvalue
    correction on every rank that collects), ``S`` on its gradient workers, and
    with adaptive refresh two snapshots of each factor this rank decomposes."""
    keys = {**KFAC, **scenario["kfac"]}
    reduction = keys.get("factor_reduction", "allreduce")
    eigen = keys.get("compute_method", "eigen") == "eigen"
    corrected = keys.get("eigenvalue_correction", False)
    moments = keys.get("eigenbasis_moments", False)
    out = {"factors": 0, "decompositions": 0, "refresh_references": 0}
    if corrected:
        out["eigenvalue_corrections"] = 0
    if moments:
        out["eigenbasis_moments"] = 0
    for name, (a_worker, g_worker, workers) in results[0]["layers"].items():
        a, g = results[0]["shapes"][name]
        floats = statistic_floats(results[0]["sides"][name], a, g)
        decomposer = {"A": a_worker, "G": g_worker, "F": a_worker}
        held = {side: n if rank == decomposer[side] else 0 for side, n in floats.items()}
        if reduction == "allreduce":
            out["factors"] += 4 * sum(floats.values()) if rank in workers else 0
        else:
            out["factors"] += 4 * sum(held.values())
        if rank in workers or (corrected and reduction != "local"):
            eigenvalues = a + g if eigen and "F" not in floats else 0
            out["decompositions"] += 4 * (sum(floats.values()) + eigenvalues)
        if corrected and rank in workers:
            out["eigenvalue_corrections"] += 4 * g * a
        if moments and rank in workers:  # m and v
            out["eigenbasis_moments"] += 2 * 4 * g * a
        if keys["inv_update_steps"] == "adaptive":
            out["refresh_references"] += 2 * 4 * sum(held.values())
    return out


def statistic_floats(sides: tuple[str, ...], a: int, g: int) -> dict[str, int]:
    """Floats of each running statistic of a block: ``A`` and ``G``, or a unit-wise BatchNorm block's ``F`` (``g``
    channels' ``a x a`` Fisher blocks), which is also its decomposition."""
    return {"F": g * a * a} if "F" in sides else {"A": a * a, "G": g * g}


def test_memory_per_rank_matches_the_formula(world_runs) -> None:
    world, runs = world_runs
    for name, results in runs.items():
        scenario = scenarios(world)[name]
        for rank, result in enumerate(results):
            got = {k: result["memory"][k] for k in expected_memory(scenario, results, rank)}
            assert got == expected_memory(scenario, results, rank), (name, rank)


def expected_bytes(world: int, scenario: dict, results: list[dict], step: int) -> dict[str, int]:
    """Documented payload bytes per step, summed over ranks (broadcasts counted at their source)."""
    keys = {**KFAC, **scenario["kfac"]}
    shapes = results[0]["shapes"]
    layers = results[0]["layers"]
    n = len(next(iter(layers.values()))[2])
    reduction, symmetric = keys.get("factor_reduction", "allreduce"), keys.get("symmetric_comm", False)
    sides = results[0]["sides"]
    unit_wise = {name for name in shapes if "F" in sides[name]}
    floats = sum(  # on the wire: Kronecker factors packed with symmetric_comm, F whole
        g * a * a if name in unit_wise else sum((d * (d + 1) // 2 if symmetric else d * d) for d in (a, g))
        for name, (a, g) in shapes.items()
    )
    corrected = keys.get("eigenvalue_correction", False)
    eigen = keys.get("compute_method", "eigen") == "eigen"

    def decomposition(name: str) -> int:
        """Floats of one layer's decomposition, each side sent once from its decomposing rank
        (``eigen-outer`` sends eigen's sides: its ``D`` is computed where it is used; unit-wise: ``F`` itself)."""
        a, g = shapes[name]
        if name in unit_wise:
            return g * a * a
        return (a * a + a) + (g * g + g) if eigen else a * a + g * g  # (Q, v) per side; (F^-1,) per side

    out = {"all_reduce": 0, "reduce": 0, "broadcast": 0}
    if world == 1:
        return out
    out["all_reduce"] = world * 4 * len(shapes)  # presence flags
    if reduction == "allreduce":
        out["all_reduce"] += world * 4 * floats
    elif reduction == "reduce":
        out["reduce"] = world * 4 * floats
    if corrected:  # S, all-reduced beside the factors (also when they are reduced to one rank)
        out["all_reduce"] += world * 4 * sum(a * g for name, (a, g) in shapes.items() if name not in unit_wise)
    if n < world:
        if keys["kl_clip"] is not None:
            out["all_reduce"] += world * 4  # the KL-clip sum
        out["broadcast"] += n * sum(4 * a * g for a, g in shapes.values())  # P(g) along rows
    holders = world if corrected and reduction != "local" else n  # the ranks each decomposition goes to
    if holders > 1 and keys.get("refresh_spread"):  # the sides in this step's slot (eigen: (Q, v) each)
        _, kfac = reference(world, steps=0, model=scenario.get("model", "mlp"), **scenario["kfac"])
        due = kfac.schedule.spread.due(step, keys["inv_update_steps"])
        out["broadcast"] += sum(4 * (d * d + d) for name, side in due for d in [shapes[name][side == "G"]])
    elif holders > 1 and step % keys["inv_update_steps"] == 0:
        out["broadcast"] += sum(4 * decomposition(name) for name in shapes)
    return out


def test_bytes_on_the_wire_match_the_formula(world_runs) -> None:
    world, runs = world_runs
    for name, results in runs.items():
        if "adaptive" in name:  # decomposition steps vary per factor; its all-reduce of intervals adds 8 bytes each
            continue
        scenario = scenarios(world)[name]
        for step in range(STEPS):
            got = {k: sum(r["comm"][step][k] for r in results) for k in ("all_reduce", "reduce", "broadcast")}
            assert got == expected_bytes(world, scenario, results, step), (name, step)


def test_state_dict_is_whole_on_the_saving_rank(world_runs) -> None:
    """Saved state does not depend on where pieces lived: rank 0 gathers every layer, equal to the
    single-process factors; the other ranks get nothing."""
    world, runs = world_runs
    name = f"fraction{1 / world:g}-reduce"
    _, kfac = reference(world, **scenarios(world)[name]["kfac"])
    results = runs[name]
    assert set(results[0]["kfac"]["layers"]) == {b.name for b in kfac.blocks}
    for layer, entry in results[0]["kfac"]["layers"].items():
        block = next(b for b in kfac.blocks if b.name == layer)
        torch.testing.assert_close(entry["A"], block.a.value, **FP32_TOL)
        torch.testing.assert_close(entry["G"], block.g.value, **FP32_TOL)
        assert len(entry["state"]) == len(block.decomposition)
    assert all(r["kfac"] is None for r in results[1:])


def test_moments_live_on_the_preconditioning_ranks_and_are_saved_whole(world_runs) -> None:
    """With ``eigenbasis_moments`` each layer's moments are kept on its gradient workers only (the memory test checks
    the bytes), and the saving rank gathers every layer's ``m``, ``v`` and update count, equal to one process's.
    ``eigh`` picks each eigenvector's sign freely (factors summed in another order can flip one), so ``m`` is compared
    in the parameter basis, ``Q_G m Q_A^T``, with each run's own saved basis; ``v`` does not change with the signs."""
    world, runs = world_runs
    for name in ("hybrid-eigenbasis-moments", "mem-opt-eigenbasis-moments-reduce"):
        scenario = scenarios(world)[name]
        _, kfac = reference(world, per_rank=scenario["per_rank"], **scenario["kfac"])
        layers = runs[name][0]["kfac"]["layers"]
        assert set(layers) == {b.name for b in kfac.blocks}
        for block in kfac.blocks:
            saved = layers[block.name]["moments"]
            assert int(saved["step"]) == block.moments.steps == STEPS
            q_a, _, q_g, _ = layers[block.name]["state"]
            ref_a, _, ref_g, _ = block.decomposition
            torch.testing.assert_close(
                q_g @ saved["exp_avg"] @ q_a.T, ref_g @ block.moments.value[0] @ ref_a.T, **FP32_TOL
            )
            torch.testing.assert_close(saved["exp_avg_sq"], block.moments.value[1], rtol=1e-4, atol=1e-10)
        if world > 1:
            placement = runs[name][0]["layers"]
            workers = {len(grad_workers) for _, _, grad_workers in placement.values()}
            assert workers == {min(2, world) if name.startswith("hybrid") else 1}, name
