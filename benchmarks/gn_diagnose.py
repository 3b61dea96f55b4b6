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
import time
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bert"))
import gn_oracle  # noqa: E402
import gn_oracle_bert  # noqa: E402
import pretrain  # noqa: E402
import recipe  # noqa: E402
import report  # noqa: E402
import run_data  # noqa: E402
import two_sided  # noqa: E402
from time_to_target import ROOT, build_phase1  # noqa: E402

import ds_kfac  # noqa: E402


def sub_batch_gradient(reference: torch.nn.Module, batch: dict[str, torch.Tensor], curvature: gn_oracle.GaussNewton
                       ) -> tuple[float, torch.Tensor]:  # fmt: skip
    """The loss of ``batch`` at ``reference``'s parameters and its gradient (flat, ``curvature``'s order)."""
    reference.zero_grad(set_to_none=True)
    loss = reference(**batch).loss
    loss.backward()
    return float(loss), curvature.flat({n: p.grad for n, p in reference.named_parameters()})


def reduction_ratio(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], start: float, gradient: torch.Tensor,
    curvature: gn_oracle.GaussNewton, step: torch.Tensor,
) -> float:  # fmt: skip
    """Martens and Grosse's ``rho``: ``batch``'s loss change over the step (``start`` before, ``model`` after) over
    the undamped quadratic model's prediction (``gradient``: ``batch``'s own)."""
    predicted = float(gradient.dot(step)) + 0.5 * float(curvature.forms([step])[0, 0])
    was_training = model.training
    with torch.no_grad():
        end = float(model.eval()(**batch).loss)
    model.train(was_training)
    return (end - start) / predicted if predicted < 0 else float("nan")


def levenberg_marquardt(damping: float, ratio: float, omega: float = 19 / 20) -> float:
    """The damping's update from the reduction ratio (Martens and Grosse, section 6.5, applied every step): down by
    ``omega`` where the model predicted well (``ratio > 3/4``), up where it did not (``< 1/4``, or no ratio)."""
    if ratio > 0.75:
        return max(damping * omega, 1e-8)
    if not ratio >= 0.25:  # NaN included
        return min(damping / omega, 1e4)
    return damping


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
    if args.two_sided is not None:  # issue 66's prototype: KL-Shampoo's two-sided factors
        print(json.dumps({"two_sided": two_sided.make_two_sided(engine.kfac.blocks, args.two_sided)}), flush=True)
    train, order, held_out = found.batches(micro, args.batch // micro)
    batches = found.loader(train, order, 0, steps)
    out = args.out / args.name
    out.mkdir(parents=True, exist_ok=True)
    writer = report.MetricsWriter(out / "metrics.csv")
    records, scales, previous, seconds, damping, upcoming = [], [], None, 0.0, args.damping, []
    for step in range(steps):
        started = time.perf_counter()
        micro_batches = upcoming or [next(batches) for _ in range(args.batch // micro)]
        upcoming = [next(batches) for _ in range(args.batch // micro)] if step + 1 < steps else []
        scored = args.every > 0 and step % args.every == 0
        if scored or args.rescale != "off":
            reference.load_state_dict(engine.module.state_dict())
            before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if scored:
            reference.zero_grad(set_to_none=True)
            for batch in micro_batches:
                (reference(**batch).loss / len(micro_batches)).backward()
            curvature = gn_oracle_bert.curvature_of(
                reference, gn_oracle_bert.joined(micro_batches, args.curvature_batch)
            )
            gradient = curvature.flat({n: p.grad for n, p in reference.named_parameters()})
            oracle, (solved,) = gn_oracle.gauss_newton_step(
                curvature, gradient, args.damping, args.cg_iterations, args.tolerance
            )
        torch.manual_seed(args.seed * 1_000_003 + step)
        loss = 0.0
        for index, batch in enumerate(micro_batches):
            out_ = engine(**batch)
            engine.backward(out_.loss)
            loss += out_.loss.item() / len(micro_batches)
            if index == len(micro_batches) - 1 and args.rescale != "off":  # the step's training gradient
                trained = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()}
            engine.step()
        if args.rescale != "off":
            # independent: the products and the slope on the next step's sequences, which the update never saw
            sub_batch = gn_oracle_bert.joined(upcoming if args.independent and upcoming else micro_batches,
                                              args.rescale_batch)  # fmt: skip
            model_at = gn_oracle_bert.curvature_of(reference, sub_batch)
            start, sub_gradient = sub_batch_gradient(reference, sub_batch, model_at)
            update = model_at.flat({n: p.detach() - before[n] for n, p in engine.module.named_parameters()})
            slope_gradient = sub_gradient if args.independent else model_at.flat(trained)
            if args.rescale == "cg":  # a truncated Gauss-Newton step from the update: CG on the sub-batch's model
                iterations = args.refine_iterations if step >= args.refine_from else 0
                solved = gn_oracle.conjugate_gradient(model_at.product, -slope_gradient, damping, iterations, 0.0,
                                                      x0=update)  # fmt: skip
                alpha = float(solved.x.dot(update) / update.dot(update))  # the refined step's length along u
                mu = float(solved.x.norm() / update.norm())  # its whole length over u's
                previous = solved.x
            else:
                alpha, mu = gn_oracle.rescaled(model_at, slope_gradient, damping, update,
                                               previous if args.rescale == "momentum" else None,
                                               args.max_scale)  # fmt: skip
                previous = alpha * update + (mu * previous if mu else 0.0)
            with torch.no_grad():
                for name, delta in model_at.split(previous).items():
                    engine.module.get_parameter(name).copy_(before[name] + delta)
            scales.append({"step": step + 1, "alpha": alpha, "mu": mu, "damping": damping})
            if args.adapt_damping:
                ratio = reduction_ratio(engine.module, sub_batch, start, sub_gradient, model_at, previous)
                damping = levenberg_marquardt(damping, ratio)
                scales[-1]["ratio"] = ratio
        seconds += time.perf_counter() - started
        row: dict[str, object] = {"step": step + 1, "samples": (step + 1) * args.batch, "seconds": f"{seconds:.3f}"}
        row.update(loss=f"{loss:.6f}", lr=f"{engine.get_lr()[0]:.6g}", data_seconds="0")
        if (step + 1) % bert["eval_every"] == 0 or step + 1 == steps:
            mlm, accuracy = pretrain.evaluate(engine, held_out)
            engine.train()
            row.update(held_out_mlm_loss=f"{mlm:.6f}", held_out_mlm_accuracy=f"{accuracy:.6f}")
        writer.write(row)
        if scored:
            update = curvature.flat({n: p.detach() - before[n] for n, p in engine.module.named_parameters()})
            found_ = gn_oracle.quadratic_report(curvature, gradient, args.damping, update, oracle)
            records.append({"step": step + 1, **found_, "cg_iterations": solved.iterations,
                            "cg_residual": solved.residual, "update_norm": float(update.norm())})  # fmt: skip
            print(json.dumps(records[-1]), flush=True)
        print(json.dumps({**row, **(scales[-1] if scales else {})}), flush=True)
    del batches
    ds_kfac.shutdown()
    keys = ("fraction", "direction", "scale", "best_scale")
    return {
        "command": "python benchmarks/gn_diagnose.py " + " ".join(args.argv),
        "config": args.config,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "argv", "phase1")},
        "phase1": phase1.name,
        "medians": {key: statistics.median(r[key] for r in records) for key in keys} if records else {},
        "steps": records,
        "rescaled": scales,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    go = sub.add_parser("run", help="score a run's updates against the oracle's steps")
    go.add_argument("--config", default="configs/bert_cpu_phase2_kfac.json")
    go.add_argument("--batch", type=int, default=256, help="global batch (micro-batches of 32)")
    go.add_argument("--every", type=int, default=10, help="score every this many steps (0: never)")
    go.add_argument(
        "--rescale",
        choices=["off", "scale", "momentum", "cg"],
        default="off",
        help="each update rescaled by the quadratic model (momentum: with the previous step, 2 x 2; cg: refined by "
        "--refine-iterations conjugate-gradient iterations on the sub-batch's damped Gauss-Newton system, from the "
        "update; alpha is then the refined step's projection on the update, mu its length over the update's)",
    )
    go.add_argument("--refine-iterations", type=int, default=2, help="--rescale cg's iterations")
    go.add_argument("--refine-from", type=int, default=0, help="--rescale cg from this step (0-based) on")
    go.add_argument("--rescale-batch", type=int, default=32, help="sequences the rescaling's products use")
    go.add_argument("--max-scale", type=float, default=4.0, help="the rescaling's cap")
    go.add_argument(
        "--independent",
        action="store_true",
        help="the rescaling's slope, products and ratio on the next step's sequences (not the update's)",
    )
    go.add_argument(
        "--adapt-damping",
        action="store_true",
        help="the rescaling's damping adapted by Levenberg-Marquardt from the sub-batch's reduction ratio",
    )
    go.add_argument(
        "--two-sided",
        type=float,
        metavar="FLOOR",
        help="K-FAC's factors estimated two-sided (two_sided.py), the other factor's eigenvalues floored at FLOOR "
        "times their mean",
    )
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
    go.add_argument("--name", help="the run's directory under --out (default: from the settings)")
    args = parser.parse_args(argv)
    args.name = args.name or f"{Path(args.config).stem}-b{args.batch}-{args.rescale}-seed{args.seed}"
    args.argv = sys.argv[1:] if argv is None else argv
    result = diagnose(args)
    path = args.out / args.name / "diagnosis.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
