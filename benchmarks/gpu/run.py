"""The GPU bundle (issue 38): the checks a lent GPU runs, one command each, each writing ``<out>/<check>.json``.

    python benchmarks/gpu/run.py --check tests      # the CUDA-only tests (fp16 engines, conventions on the device)
    python benchmarks/gpu/run.py --check fp16       # fp16 ZeRO 1/2, dynamic loss scale: G, overflow, no NaN
    python benchmarks/gpu/run.py --check lamb       # JSON Lamb resolves to FusedLamb with K-FAC on, = ds_kfac.Lamb
    python benchmarks/gpu/run.py --check lamb --arch-list device  # the same with TORCH_CUDA_ARCH_LIST=<the GPUs'>
    python benchmarks/gpu/run.py --check linalg     # a refresh's eigh vs warm-started updates (QR, Cholesky-QR2)
    python benchmarks/gpu/run.py --check hooks      # a plain micro-batch with K-FAC's hooks and without
    python benchmarks/gpu/run.py --check step-cost  # step_cost.py at BERT-base shapes, GA 1/8/32, eigenbasis, async
    python benchmarks/gpu/run.py --check bert       # BERT-small and -base time to target, batch 256-4,096, tuned
    ... --device cpu --tiny                         # the same at toy sizes on the CPU (fp16 becomes bf16 there)

``--out`` defaults to ``$OUT`` (the device tool's folder) or ``runs/gpu``. Every JSON holds ``check``,
``command``, ``device``, ``tiny``, ``environment`` (Python, torch, CUDA, cuDNN, driver, GPU, DeepSpeed,
transformers, ds_kfac's commit), ``arch_list`` (``TORCH_CUDA_ARCH_LIST`` as the check ran: ``--arch-list``, the
value, and the value the environment had), ``seconds``, ``passed`` and the check's own results; with ``--arch-list``
the file is ``<check>_arch_<mode>.json``. ``run_all.sh`` runs them in the order and time budget of two device calls;
README.md beside this file says how.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "tests" / "workers")]
import convergence  # noqa: E402  (benchmarks/gpu/convergence.py)
import hook_cost  # noqa: E402
import launch  # noqa: E402  (tests/launch.py)
import linalg  # noqa: E402  (benchmarks/gpu/linalg.py: run.py's own folder)
import step_cost  # noqa: E402
import time_to_target as ttt  # noqa: E402

from ds_kfac.integration.cuda_ops import ARCH_LIST_ENV, buildable_arch_list, device_capabilities  # noqa: E402

Result = dict[str, Any]
KFAC = {"damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}
"""The K-FAC section of the engine checks (fp16, lamb): every step a factor step, decompositions every 2."""


# ---------------------------------------------------------------- environment
def environment() -> dict[str, Any]:
    """What a result was measured with: software versions, the GPU and its driver, ds_kfac's commit."""
    import deepspeed
    import transformers

    cuda = torch.cuda.is_available()
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if cuda
        else None
    )
    return {
        **ttt.versions(),
        "ds_kfac_commit": os.environ.get("DS_KFAC_COMMIT") or ttt.versions()["ds_kfac_commit"] or "unknown",
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpus": torch.cuda.device_count(),
        "nvidia_smi": smi.stdout.strip() if smi is not None else None,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
    }


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested dict/list, by its dotted path (a K-FAC state's layers: A, G, moments...)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, sub in items for k, v in tensors(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


# ---------------------------------------------------------------- a. the tests that need CUDA
TESTS = ["tests/test_deepspeed.py::test_fp16_dynamic_loss_scale_on_gpu", "tests/test_conventions_cuda.py"]


def check_tests(args: argparse.Namespace) -> Result:
    """pytest on :data:`TESTS` (on the CPU, the conventions run there and the fp16 engines skip); a JUnit summary."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *TESTS]
        env = {**os.environ, "DS_KFAC_TEST_DEVICE": args.device}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        cases = [
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "seconds": float(case.get("time", 0.0)),
                "outcome": next(
                    (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
                ),
                "message": next((child.get("message", "")[:2000] for child in case), ""),
            }
            for case in ET.parse(xml).getroot().iter("testcase")
        ]
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failure", "error", "skipped")}
    return {
        "passed": proc.returncode == 0,
        "pytest": shlex.join(cmd),
        "counts": counts,
        "cases": cases,
        "output_tail": proc.stdout[-3000:],
    }


# ---------------------------------------------------------------- b. fp16 with a dynamic loss scale
ADAMW = {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01}}
EIGENBASIS = {"eigenbasis_moments": True, "factor_update_steps": 1, "inv_update_steps": 2}
STEPS = 5
LOW_TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}
"""Relative error allowed for the low-precision run's factors against the fp32 run's (11 and 8 mantissa bits)."""


def precision(device: str) -> str:
    """fp16 on CUDA; bf16 on the CPU, where DeepSpeed refuses fp16 (the dry run's stand-in)."""
    return "fp16" if device == "cuda" else "bf16"


def fp16_scenarios(device: str, tiny: bool) -> dict[str, dict[str, Any]]:
    """Per ZeRO stage (1 and 2; 1 only when tiny): fp32 and low precision (dynamic loss scale from 2^12 in fp16); an
    overflow (a NaN loss) at the last step and the same run stopped before it, with plain K-FAC and with the
    eigenbasis moments under AdamW; and an overflow mid-run against the run that leaves that step out."""
    low = {"fp16": {"enabled": True, "initial_scale_power": 12}} if device == "cuda" else {"bf16": {"enabled": True}}
    out = {}
    for stage in (1,) if tiny else (1, 2):
        zero = {"zero_optimization": {"stage": stage}}
        mixed = {**zero, **low}
        out |= {
            f"fp32_s{stage}": {"ds": zero, "kfac": KFAC, "steps": STEPS},
            f"low_s{stage}": {"ds": mixed, "kfac": KFAC, "steps": STEPS},
            f"overflow_last_s{stage}": {"ds": mixed, "kfac": KFAC, "steps": 3, "nan_step": 2},
            f"before_overflow_s{stage}": {"ds": mixed, "kfac": KFAC, "steps": 2},
            f"eig_overflow_last_s{stage}": {
                "ds": {**mixed, "optimizer": ADAMW},
                "kfac": EIGENBASIS,
                "steps": 3,
                "nan_step": 2,
            },
            f"eig_before_overflow_s{stage}": {"ds": {**mixed, "optimizer": ADAMW}, "kfac": EIGENBASIS, "steps": 2},
            f"overflow_s{stage}": {"ds": mixed, "kfac": KFAC, "steps": STEPS, "nan_step": 2},
            f"skipped_s{stage}": {"ds": mixed, "kfac": KFAC, "steps": STEPS, "skip_steps": [2]},
        }
    return out


def fp16_verdict(runs: dict[str, list[dict[str, Any]]], low: str) -> Result:
    """Rank 0's results of :func:`fp16_scenarios` judged: ``G`` and ``A`` within :data:`LOW_TOLERANCE` of fp32's,
    the parameters within the fp16 test's tolerance; an overflowed step leaves factors, moments and parameters
    bitwise as they were, is counted as skipped, and no NaN reaches the parameters."""
    stages = sorted({int(name.rsplit("_s", 1)[1]) for name in runs})
    report: Result = {"precision": low, "stages": {}}
    for stage in stages:
        get = {name.rsplit("_s", 1)[0]: result[0] for name, result in runs.items() if name.endswith(f"_s{stage}")}
        fp32, mixed = get["fp32"], get["low"]
        factors = {
            f"{layer}.{key}": relative_error(mixed["kfac"]["layers"][layer][key], entry[key])
            for layer, entry in fp32["kfac"]["layers"].items()
            for key in ("A", "G")
        }
        params = max(relative_error(a, b) for a, b in zip(mixed["params"], fp32["params"]))
        untouched = {}
        for prefix in ("", "eig_"):
            over, before = get[f"{prefix}overflow_last"], get[f"{prefix}before_overflow"]
            state, expected = tensors(over["kfac"]["layers"]), tensors(before["kfac"]["layers"])
            untouched[prefix or "plain"] = {
                "skipped_steps": over["skipped_steps"],
                "kfac_steps": [over["kfac"]["steps"], before["kfac"]["steps"]],
                "state_keys": sorted({k.split(".", 1)[1] for k in expected}),
                "state_equal": state.keys() == expected.keys()
                and all(torch.equal(state[k], expected[k]) for k in state),
                "params_equal": all(torch.equal(a, b) for a, b in zip(over["params"], before["params"])),
            }
        mid, skipped = get["overflow"], get["skipped"]
        finite = all(bool(torch.isfinite(p).all()) for p in mid["params"])
        after = max(relative_error(a, b) for a, b in zip(mid["params"], skipped["params"]))
        checks = {
            "factors_close": max(factors.values()) < LOW_TOLERANCE[low],
            "params_close": params < LOW_TOLERANCE[low],
            "overflow_untouched": all(
                u["state_equal"] and u["params_equal"] and u["skipped_steps"] == 1 and len(set(u["kfac_steps"])) == 1
                for u in untouched.values()
            ),
            "moments_checked": any(key.startswith("moments") for key in untouched["eig_"]["state_keys"]),
            "no_nan_after_overflow": finite and mid["kfac"]["steps"] == STEPS - 1,
            "overflow_then_as_skipped": after < LOW_TOLERANCE[low],
        }
        report["stages"][str(stage)] = {
            "checks": checks,
            "factor_relative_error": factors,
            "param_relative_error_vs_fp32": params,
            "overflow_last_step": untouched,
            "param_relative_error_overflow_vs_skipped": after,
        }
    report["passed"] = all(all(s["checks"].values()) for s in report["stages"].values())
    return report


def check_fp16(args: argparse.Namespace) -> Result:
    """:func:`fp16_scenarios` in one ``deepspeed`` launch (``tests/workers/ds_worker.py``) on one GPU per rank, up
    to 2 (one on the CPU), judged by :func:`fp16_verdict`."""
    world = min(2, torch.cuda.device_count()) if args.device == "cuda" else 1
    scenarios = fp16_scenarios(args.device, args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        results = launch.deepspeed_run(world, Path(tmp), list(scenarios.values()), timeout=args.timeout)
    report = fp16_verdict(dict(zip(scenarios, results)), precision(args.device))
    note = None if args.device == "cuda" else "DeepSpeed refuses fp16 on the CPU: bf16 stands in, no dynamic scale"
    return {**report, "world": world, "note": note}


# ---------------------------------------------------------------- c. Lamb -> FusedLamb with K-FAC on
LAMB = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.01}
LAMB_STEPS = 3
FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}


def lamb_engines(device: str) -> Result:
    """Two one-rank K-FAC engines from the same weights on the same batches: the JSON ``"Lamb"`` (which
    ``resolve_lamb`` turns into DeepSpeed's ``FusedLamb`` on CUDA) and a client ``ds_kfac.Lamb``; after each step the
    largest parameter difference. Needs the launcher's environment (one rank) and ends nothing."""
    import problem

    import ds_kfac

    ds_kfac.init_distributed()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "kfac": KFAC,
    }
    fused_model, torch_model = problem.make_model(), problem.make_model()
    arch_list = os.environ.get(ARCH_LIST_ENV)
    with warnings.catch_warnings(record=True) as caught:  # resolve_lamb says why no fused LAMB was built
        warnings.simplefilter("always")
        fused, *_ = ds_kfac.initialize(
            model=fused_model,
            model_parameters=fused_model.parameters(),
            config={**config, "optimizer": {"type": "Lamb", "params": LAMB}},
        )
    reference = ds_kfac.Lamb(torch_model.parameters(), **{**LAMB, "betas": tuple(LAMB["betas"])})
    plain, *_ = ds_kfac.initialize(model=torch_model, optimizer=reference, config=config)
    differences = []
    for step in range(LAMB_STEPS):
        x, y = problem.global_batch(step, 8)
        for engine in (fused, plain):
            engine.backward(problem.loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
            engine.step()
        pairs = list(zip(fused.module.parameters(), plain.module.parameters()))
        differences.append(max(float((a - b).detach().abs().max()) for a, b in pairs))
        for a, b in pairs:
            torch.testing.assert_close(a, b, **FP32_TOL)
    resolved = type(fused.basic_optimizer).__name__
    expected = "FusedLamb" if device == "cuda" else "Lamb"
    restored = os.environ.get(ARCH_LIST_ENV) == arch_list  # the FusedLamb build sets it, then puts it back
    return {
        "passed": resolved == expected and restored,
        "resolved": resolved,
        "expected": expected,
        "arch_list_restored": restored,
        "kfac_on": fused.kfac is not None,
        "warnings": [str(w.message)[:2000] for w in caught],
        "max_abs_difference_per_step": differences,
        "tolerance": FP32_TOL,
    }


def check_lamb(args: argparse.Namespace) -> Result:
    """:func:`lamb_engines` in this process, as one rank (an assertion failure is a failed check)."""
    for key, value in launch.one_rank_env().items():
        os.environ.setdefault(key, value)
    try:
        return lamb_engines(args.device)
    except AssertionError as error:
        return {"passed": False, "error": str(error)[:3000]}


# ---------------------------------------------------------------- d. step cost at BERT-base shapes
MIN_LAUNCH = 20.0
"""Seconds below which a check starts no further launch: one could not finish (start-up alone takes about 10)."""


def launch_timeout(args: argparse.Namespace, start: float) -> Optional[float]:
    """The next launch's time limit: ``--timeout``, cut to what is left of ``--budget`` (counted from ``start``) so
    the check ends, and writes its JSON, inside the budget; ``None`` when less than :data:`MIN_LAUNCH` is left."""
    if args.budget is None:
        return args.timeout
    left = args.budget - (time.perf_counter() - start)
    return None if left < MIN_LAUNCH else min(args.timeout, left)


def step_cost_runs(device: str, tiny: bool, timeout: float) -> dict[str, list[str]]:
    """The ``step_cost.py run`` invocations, by name: BERT-base on one GPU, LAMB as ``resolve_lamb`` picks it
    (FusedLamb), the BERT demo's cadence (factors every 5 steps, the last micro-batch's; decompositions every 25). In
    that order, the most wanted first: GA 8 with the method as shipped (the eigenbasis key, warm-started bases,
    refreshes spread over the cycle: issue 45's targets) in float32, with bf16 models (``--dtype bfloat16``, the model
    half of DeepSpeed's bf16) and with TF32 matmuls allowed (``--matmul-precision high``, the user's switch), with
    no basis kept (``basis_keep_drift`` 0: this benchmark's random tokens move the factors so little that the shipped
    0.1 keeps every basis, so the two runs bound a training's mix of kept and subspace-stepped sides), and
    with the key as it was before (exact bases, all refreshes at once), GA 1 and 8 with plain K-FAC, GA 8 with async
    decompositions, GA 32 on one cycle, the inverse method.
    Tiny: the smoke sizes (BERT-tiny, cadence 2/4) at GA 1, one cycle."""
    common = ["run", "--workloads", "bert-base", "--worlds", "1", "--device", device, "--timeout", str(timeout)]
    plain = ["--set", "eigenbasis_moments=false"]
    if tiny:
        return {"smoke": [*common, "--smoke", "--ga", "1", "--cycles", "1", *plain]}
    cadence = ["--set", "factor_update_steps=5", "--set", "inv_update_steps=25"]
    slower = ["--set", "factor_update_steps=10", "--set", "inv_update_steps=100"]
    inverse = ["--set", "compute_method=inverse"]
    unspread = ["--set", "refresh_spread=false"]
    return {
        "shipped_ga8": [*common, *cadence, "--ga", "8", "--cycles", "2"],
        "shipped_bf16_ga8": [*common, *cadence, "--dtype", "bfloat16", "--ga", "8", "--cycles", "1"],
        "shipped_tf32_ga8": [*common, *cadence, "--matmul-precision", "high", "--ga", "8", "--cycles", "1"],
        "subspace_ga8": [*common, *cadence, "--set", "basis_keep_drift=0.0", "--ga", "8", "--cycles", "1"],
        "exact_unspread_ga8": [
            *common,
            *cadence,
            "--set",
            'basis_update="exact"',
            "--set",
            "basis_keep_drift=0.0",  # the exact mode keeps no basis
            *unspread,
            "--ga",
            "8",
            "--cycles",
            "1",
        ],
        "plain_ga1_ga8": [*common, *cadence, *plain, "--ga", "1", "8", "--cycles", "2"],
        "async_ga8": [
            *common,
            *cadence,
            *plain,
            *unspread,
            "--set",
            "async_decompositions=true",
            "--ga",
            "8",
            "--cycles",
            "2",
        ],
        "plain_ga32": [*common, *cadence, *plain, "--ga", "32", "--cycles", "1", "--warmup-steps", "5"],
        # After the first GPU run (decompositions 2.5 s a refresh by eigh, preconditioning 27 ms a step): the inverse
        # method (a Cholesky inverse a refresh, two matmuls a layer a step), at the demo's cadence and a longer one.
        "inverse_ga8": [*common, *cadence, *plain, *unspread, *inverse, "--ga", "8", "--cycles", "1"],
        "inverse_10_100_ga8": [*common, *slower, *plain, *unspread, *inverse, "--ga", "8", "--cycles", "1"],
    }


def _ratio_target(name: str, ga: int, ratio: float) -> Optional[bool]:
    """Whether a run meets its step-ratio target at GA 8 (``None``: it has none)."""
    limits = {"shipped_bf16": 1.25, "shipped": 1.15, "plain": 1.10, "async": 1.10}  # the first prefix that matches
    limit = next((v for k, v in limits.items() if name.startswith(k)), None)
    return ratio <= limit if limit is not None and ga == 8 else None


def _slowest_target(name: str, slowest_over_median: float) -> Optional[bool]:
    """Whether a run meets its slowest-step target (``None``: it has none)."""
    limits = {"shipped": 1.5, "async": 1.2}
    limit = next((v for k, v in limits.items() if name.startswith(k)), None)
    return slowest_over_median <= limit if limit is not None else None


def check_step_cost(args: argparse.Namespace) -> Result:
    """Each of :func:`step_cost_runs` in turn (one failing or timing out does not stop the rest; each launch's limit
    cut to what is left of ``--budget``, none started when too little is left); their JSONs merged into this check's,
    with the table and the targets: issue 45's for the shipped method (its step <= 1.15x LAMB's at GA 8 in float32
    and with TF32, <= 1.25x in bf16, amortized at the cadence; its slowest step <= 1.5x the median), plain K-FAC's step <= 1.10x at GA 8, the slowest
    step <= 1.2x the median with async decompositions."""
    runs: Result = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        planned = step_cost_runs(args.device, args.tiny, args.timeout)
        for name in args.only or planned:
            argv = planned[name]
            timeout = launch_timeout(args, start)
            if timeout is None:
                runs[name] = {"error": f"not started: the check's budget of {args.budget:.0f}s was spent"}
                continue
            argv = [str(timeout) if previous == "--timeout" else a for previous, a in zip(["", *argv], argv)]
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks/step_cost.py"), *argv, "--out", str(out)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            runs[name] = (
                json.loads(out.read_text())
                if proc.returncode == 0
                else {"error": f"exit {proc.returncode}", "output_tail": (proc.stdout + proc.stderr)[-3000:]}
            )
            print(f"step cost {name}: {'done' if proc.returncode == 0 else runs[name]['error']}", flush=True)
    done = [r for r in runs.values() if "error" not in r]
    targets = {}
    for name, result in runs.items():
        for c in result.get("configurations", []):
            kfac = c["arms"]["kfac"]
            targets[f"{name} GA{c['ga']}"] = {
                "ratio": c["ratio"]["mean"],
                "slowest_over_median": kfac["slowest_ms"] / kfac["median_ms"],
                "meets": _ratio_target(name, c["ga"], c["ratio"]["mean"]),
                "meets_slowest": _slowest_target(name, kfac["slowest_ms"] / kfac["median_ms"]),
            }
    return {
        "passed": len(done) == len(runs),
        "runs": runs,
        "table": step_cost.table(done) if done else None,
        "targets": targets,
    }


# ---------------------------------------------------------------- e. the hooks on plain micro-batches
def check_hooks(args: argparse.Namespace) -> Result:
    """``benchmarks/hook_cost.py`` in this process: BERT-base's plain micro-batch (16 x 128) with K-FAC's hooks and
    without, 30 alternating rounds (tiny: BERT-mini at its smoke size, 3 rounds); passes when it ran."""
    name, repeats = ("bert-mini", 3) if args.tiny else ("bert-base", 30)
    try:
        result = hook_cost.measure(name, repeats, torch.device(args.device), args.tiny)
    finally:
        hook_cost.ds_kfac.shutdown()
    return {"passed": True, **result}


# ---------------------------------------------------------------- driver
ARCH_LIST_MODES = ("unset", "device")
"""``--arch-list``: the check runs with ``TORCH_CUDA_ARCH_LIST`` unset, or set to the visible GPUs' capabilities
(``"9.0"`` on an H100), so the bundle covers FusedLamb's build both ways (issue 45)."""


def set_arch_list(mode: Optional[str]) -> Optional[str]:
    """Set ``TORCH_CUDA_ARCH_LIST`` in this process (and the launches it makes) for ``--arch-list``; its value after
    (``None``: unset). ``device`` without a GPU (the dry run) leaves it unset."""
    if mode is not None:
        os.environ.pop(ARCH_LIST_ENV, None)
    if mode == "device":
        value = buildable_arch_list(None, device_capabilities())
        if value is not None:
            os.environ[ARCH_LIST_ENV] = value
    return os.environ.get(ARCH_LIST_ENV)


CHECKS: dict[str, Callable[[argparse.Namespace], Result]] = {
    "tests": check_tests,
    "fp16": check_fp16,
    "lamb": check_lamb,
    "linalg": lambda args: linalg.check_linalg(args.device, args.tiny),
    "hooks": check_hooks,
    "step-cost": check_step_cost,
    "bert": convergence.check,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", choices=list(CHECKS), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes and steps: the dry run")
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs" / "gpu"
    parser.add_argument("--out", type=Path, default=default_out, help="where <check>.json goes (default: $OUT)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (a step-cost run, a BERT run)")
    parser.add_argument("--budget", type=float, help="step-cost, bert: seconds for all the check's launches")
    parser.add_argument("--only", nargs="+", help="step-cost: these runs of step_cost_runs, in this order")
    parser.add_argument(
        "--arch-list",
        choices=ARCH_LIST_MODES,
        help="TORCH_CUDA_ARCH_LIST for the check (lamb: FusedLamb's build): unset, or the GPUs' capabilities; "
        "default: as the environment has it",
    )
    convergence.add_arguments(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny for the dry run)")
    inherited = os.environ.get(ARCH_LIST_ENV)
    arch_list = {"mode": args.arch_list, "value": set_arch_list(args.arch_list), "inherited": inherited}
    start = time.perf_counter()
    try:
        result = CHECKS[args.check](args)
    finally:
        with contextlib.suppress(Exception):  # the lamb check's process group, if it made one
            import ds_kfac

            ds_kfac.shutdown()
    record = {
        "check": args.check,
        "command": shlex.join(["python", "benchmarks/gpu/run.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": args.device,
        "tiny": args.tiny,
        "arch_list": arch_list,
        "environment": environment(),
        "seconds": time.perf_counter() - start,
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.check.replace('-', '_')}{f'_arch_{args.arch_list}' if args.arch_list else ''}.json"
    record = ttt.portable(record)
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"{args.check}: {'passed' if record['passed'] else 'FAILED'} in {record['seconds']:.0f}s -> {path}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
