"""K-FAC's predicted overhead and memory per rank for BERT-large at 64 to 1,024 GPUs, per placement (issue 68, item 5).

No cluster is at hand, so the calibration ``python -m ds_kfac.plan --calibrate`` would measure there is assembled from
what was measured and what is stated, each named in the result:

* **compute**: K-FAC's phases measured on one H100 for BERT-base at world 1 (a committed ``benchmarks/gpu`` step-cost
  run: ``--from``, ``--run``, ``--ga``), scaled to BERT-large phase by phase by the arithmetic each phase does (the
  factors' products ``tokens x sum(a^2 + g^2)``, the running averages ``sum(dim^2)``, the decompositions
  ``sum(dim^3)``, preconditioning ``sum(g a (g + a))``, the forward and backward the Linear layers'
  multiply-adds times the tokens) over the layers K-FAC registers in each;
* **network**: each ``--network NAME=latency=S,bandwidth=B`` (per-GPU bandwidth between nodes, the slowest link of
  a ring or tree spanning nodes), costed by :mod:`ds_kfac.comm.network`'s algorithms at each world size;
* **the rest** is the planner's: each rank's roles, bytes and memory under each placement (``plan_job``).

::

    python benchmarks/predict_scale.py --worlds 64 256 1024 \\
        --network ib200=latency=1e-5,bandwidth=2.5e10 --network ib400=latency=1e-5,bandwidth=5e10 \\
        --out benchmarks/results/placement_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_kfac.planning import plan_job, read_job  # noqa: E402
from ds_kfac.planning.models import bert_config, bert_on_meta  # noqa: E402
from ds_kfac.planning.predict import Calibration, predict_plan  # noqa: E402
from ds_kfac.planning.predict import arithmetic as block_arithmetic  # noqa: E402
from ds_kfac.planning.report import held  # noqa: E402
from ds_kfac.preconditioning.build import model_blocks  # noqa: E402

GPU_RUN = "benchmarks/results/gpu/h100-2026-11-27/call1/step_cost.json"
CALIBRATED_ON = {"model": "bert-base", "micro_batch": 16, "seq": 128, "config": "configs/bert_cpu_phase1_kfac.json"}
"""step_cost.py's ``bert-base`` workload: BERT-base at micro-batch 16 x 128 tokens, its config's ``"kfac"`` skips."""
MEASURED = ("hooks", "factors", "decompose", "rebase", "stack", "precondition")
"""The phases the GPU run measured, each scaled by its arithmetic."""


def arithmetic(model: nn.Module, section: dict[str, Any], tokens: int) -> dict[str, float]:
    """Each measured phase's arithmetic for ``model``'s K-FAC layers (the predictor's per-layer weights, summed; the
    factors' products times ``tokens``), and the forward and backward's (every Linear layer's multiply-adds per
    token, times ``tokens``)."""
    from ds_kfac import KFACConfig

    blocks, _ = model_blocks(model, KFACConfig.parse(section))
    out = {p: sum(block_arithmetic(b)[p] for b in blocks) for p in MEASURED}
    out["hooks"] *= tokens
    macs = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    return {**out, "forward_backward": tokens * macs}


def measured_phases(path: Path, run: str, ga: int) -> tuple[dict[str, float], float, dict[str, int], str]:
    """K-FAC's seconds per step by phase (its untimed rest with ``precondition``), the forward and backward's, the
    cadence and the GPU, from a committed ``benchmarks/gpu`` step-cost run at world 1."""
    data = json.loads(path.read_text())
    (config,) = [c for c in data["runs"][run]["configurations"] if c["ga"] == ga and c["world"] == 1]
    kfac = config["arms"]["kfac"]
    phases = {p: kfac["phases_ms"].get(p, 0.0) / 1e3 for p in MEASURED if p != "precondition"}
    phases["precondition"] = (kfac["phases_ms"].get("precondition", 0.0) + kfac.get("untimed_ms", 0.0)) / 1e3
    cadence = {k: config["kfac_config"][k] for k in ("factor_update_steps", "inv_update_steps")}
    return phases, kfac["phases_ms"]["forward_backward"] / 1e3, cadence, data["environment"]["gpu"]


def scaled_calibration(args: argparse.Namespace, job_path: str) -> tuple[Calibration, dict[str, Any]]:
    """The calibration of ``job_path``'s model on the measured GPU (module docstring); no network yet."""
    phases, forward_backward, cadence, gpu = measured_phases(ROOT / args.gpu_run, args.run, args.ga)
    base_section = json.loads((ROOT / CALIBRATED_ON["config"]).read_text())["kfac"]
    base_model, _ = bert_on_meta(bert_config(CALIBRATED_ON["model"], {"vocab_size": 30522, "max_seq_length": 128}))
    base = arithmetic(base_model, base_section, CALIBRATED_ON["micro_batch"] * CALIBRATED_ON["seq"])
    job = read_job(ROOT / job_path, 1)
    model, _ = bert_on_meta(bert_config(job.bert["model"], job.bert))
    target = arithmetic(model, job.section, job.micro_batch * job.bert["max_seq_length"])
    ratios = {p: target[p] / base[p] for p in base}
    calibration = Calibration(
        device=gpu,
        world=1,
        phases={p: s * ratios[p] for p, s in phases.items()},
        forward_backward=forward_backward * ratios["forward_backward"] / args.ga,  # one micro-batch's
        accumulation=1,
        micro_batch=job.micro_batch,  # the tokens' ratio is in the hooks' scaling above
        collected=1,  # the GPU run collected one micro-batch a factor step: phases["hooks"] is one micro-batch's
        cadence=cadence,
    )
    return calibration, {"gpu": gpu, "arithmetic_ratios": ratios}


def predict(args: argparse.Namespace) -> dict[str, Any]:
    rows, assumptions = [], {}
    for job_path in args.configs:
        measured, assumptions[job_path] = scaled_calibration(args, job_path)
        for world in args.worlds:
            job = read_job(ROOT / job_path, world)
            model, groups = bert_on_meta(bert_config(job.bert["model"], job.bert))
            plan = plan_job(model, job, args.fractions, [job.kfac.factor_reduction], groups)
            base = measured.forward_backward_for(job.micro_batch, job.accumulation)
            for name, network in args.network:
                calibration = dataclasses.replace(measured, network=network)
                for placement, time in zip(plan.placements, predict_plan(plan, calibration)):
                    if time.refused:
                        continue
                    rows.append(
                        {
                            "config": job_path,
                            "network": name,
                            "world": world,
                            "fraction": placement.fraction,
                            "micro_batch": job.micro_batch,
                            "accumulation": job.accumulation,
                            "overhead_ms": 1e3 * time.overhead,
                            "forward_backward_ms": 1e3 * base,
                            "overhead_share": time.overhead / base,
                            "phases_ms": {p: 1e3 * s for p, s in time.slowest.items()},
                            "kfac_memory_mib": max(held(c) for c in placement.ranks) / 2**20,
                        }
                    )
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "phases_ms"}), flush=True)
    return {
        "command": shlex.join(["python", "benchmarks/predict_scale.py", *args.argv]),
        "calibrated_on": {**CALIBRATED_ON, "gpu_run": args.gpu_run, "run": args.run, "ga": args.ga},
        "networks": dict(args.network),
        "assumptions": assumptions,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    """Markdown: per config, network and world, each placement's overhead (ms and share of the step's forward and
    backward) and K-FAC memory per rank."""
    lines = [
        "| config | network | GPUs | placement | K-FAC ms a step | of fwd+bwd | K-FAC MiB a rank |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {Path(r['config']).stem} | {r['network']} | {r['world']} | {r['fraction']} | {r['overhead_ms']:,.1f} "
            f"| {100 * r['overhead_share']:.1f}% | {r['kfac_memory_mib']:,.0f} |"
        )
    return "\n".join(lines)


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["configs/bert_large_phase1_kfac.json",
                                                          "configs/bert_large_phase2_kfac.json"])  # fmt: skip
    parser.add_argument("--worlds", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--fractions", nargs="+", default=["comm-opt", "hybrid-opt", "mem-opt"])
    parser.add_argument("--network", action="append", type=lambda v: tuple(v.split("=", 1)), required=True,
                        metavar="NAME=latency=S,bandwidth=B")  # fmt: skip
    parser.add_argument("--gpu-run", default=GPU_RUN)
    parser.add_argument("--run", default="plain_ga1_ga8")
    parser.add_argument("--ga", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse(argv)
    result = predict(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
