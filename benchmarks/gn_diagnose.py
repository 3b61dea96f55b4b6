"""Where an optimizer's step falls short of the Gauss-Newton oracle's, along a real run of the BERT demo's phase 2:
every ``--every`` steps, the update the run made (its parameters after the step minus before) is scored on the
step's batch by the damped quadratic model against the oracle's step there (``gn_oracle.quadratic_report``)::

    python benchmarks/gn_diagnose.py run --config configs/bert_cpu_phase2_kfac.json [--every 10] [--batch 256] \\
        [--damping 1e-2] [--curvature-batch 64] [--cg-iterations 20] [--out runs/gn_diagnose]

One process (world 1, the global batch by accumulation), ``ds_kfac.initialize`` on the config as the demo builds it
(any optimizer: ds_kfac, AdamW, DeepSpeed's Muon), from the demo's phase-1 checkpoint, the demo's batches. The
model runs with eager attention (the oracle's forward-mode products need it), the run itself with dropout; the
gradient and the curvature at the step's starting point without it. ``diagnosis.json`` holds, per scored step, the
fraction of the oracle's model reduction the update achieves, its direction's share (the update at its best scale)
and its scale's (the best scale itself: above 1, the run stepped too short), and the oracle's solve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bert"))
import gn_oracle  # noqa: E402
import gn_oracle_bert  # noqa: E402
import pretrain  # noqa: E402
import recipe  # noqa: E402
import run_data  # noqa: E402
from time_to_target import ROOT, build_phase1  # noqa: E402

import ds_kfac  # noqa: E402


def diagnose(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    ds_kfac.init_distributed()
    phase1 = args.phase1 or build_phase1(args.timeout)
    cli = pretrain.parse_args(["--deepspeed_config", str(ROOT / args.config), "--init-checkpoint", str(phase1),
                               "--seed", str(args.seed), "--cache-dir", str(ROOT / "runs" / "bert-cache"),
                               "--loader-workers", "0"])  # fmt: skip
    config, bert = recipe.read_config(cli.deepspeed_config)
    micro = min(32, args.batch)
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=args.batch // micro)
    config.pop("train_batch_size", None)
    steps = args.steps or bert["max_steps"]
    found = run_data.open_data(cli, bert, cli.cache_dir)
    torch.manual_seed(args.seed)
    model = gn_oracle_bert.model_from(phase1, bert, found.vocab_size).train()
    reference = gn_oracle_bert.model_from(phase1, bert, found.vocab_size)  # the oracle's copy, at each step's start
    schedule = pretrain.poly_warmup(steps, bert["warmup_proportion"], bert["poly_power"])
    engine = pretrain.build_engine(model, config, schedule, args.seed)
    train, order, _ = found.batches(micro, args.batch // micro)
    batches = found.loader(train, order, 0, steps)
    records = []
    for step in range(steps):
        micro_batches = [next(batches) for _ in range(args.batch // micro)]
        scored = step % args.every == 0
        if scored:
            reference.load_state_dict(engine.module.state_dict())
            reference.zero_grad(set_to_none=True)
            for batch in micro_batches:
                (reference(**batch).loss / len(micro_batches)).backward()
            sub_batch = gn_oracle_bert.joined(micro_batches, args.curvature_batch)
            curvature = gn_oracle_bert.curvature_of(reference, sub_batch)
            gradient = curvature.flat({n: p.grad for n, p in reference.named_parameters()})
            oracle, (solved,) = gn_oracle.gauss_newton_step(
                curvature, gradient, args.damping, args.cg_iterations, args.tolerance
            )
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.manual_seed(args.seed * 1_000_003 + step)
        for batch in micro_batches:
            engine.backward(engine(**batch).loss)
            engine.step()
        if scored:
            update = curvature.flat({n: p.detach() - before[n] for n, p in engine.module.named_parameters()})
            report = gn_oracle.quadratic_report(curvature, gradient, args.damping, update, oracle)
            records.append({"step": step + 1, **report, "cg_iterations": solved.iterations,
                            "cg_residual": solved.residual, "update_norm": float(update.norm())})  # fmt: skip
            print(json.dumps(records[-1]), flush=True)
    del batches
    ds_kfac.shutdown()
    keys = ("fraction", "direction", "scale", "best_scale")
    return {
        "command": "python benchmarks/gn_diagnose.py " + " ".join(args.argv),
        "config": args.config,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "argv", "phase1")},
        "phase1": phase1.name,
        "medians": {key: statistics.median(r[key] for r in records) for key in keys},
        "steps": records,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    go = sub.add_parser("run", help="score a run's updates against the oracle's steps")
    go.add_argument("--config", default="configs/bert_cpu_phase2_kfac.json")
    go.add_argument("--batch", type=int, default=256, help="global batch (micro-batches of 32)")
    go.add_argument("--every", type=int, default=10, help="score every this many steps")
    go.add_argument("--damping", type=float, default=1e-2)
    go.add_argument("--curvature-batch", type=int, default=64)
    go.add_argument("--cg-iterations", type=int, default=20)
    go.add_argument("--tolerance", type=float, default=1e-3)
    go.add_argument("--steps", type=int)
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--threads", type=int, default=2)
    go.add_argument("--port", type=int, default=29534)
    go.add_argument("--phase1", type=Path)
    go.add_argument("--timeout", type=float, default=3600.0)
    go.add_argument("--out", type=Path, default=ROOT / "runs" / "gn_diagnose")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    result = diagnose(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{Path(args.config).stem}-b{args.batch}-seed{args.seed}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
