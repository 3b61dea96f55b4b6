"""The Gauss-Newton oracle (``gn_oracle.py``) training the BERT demo's phase 2: each step the damped Gauss-Newton
step of the step's batch, whole-model or layer by layer, solved by conjugate gradient, on one process::

    python benchmarks/gn_oracle_bert.py run --batch 256 --damping 1e-2 --lr 1.0 [--layerwise] [--momentum 0.9] \\
        [--curvature-batch 64] [--cg-iterations 10] [--out runs/gn_oracle]

It starts from the demo's phase-1 checkpoint (``examples/bert/phase1.py``, built once) and reads the embedded
corpus's prepared shards in the demo's sample order, so step ``s`` trains on the global batch every arm of the
batch study trains on at step ``s`` (the order is the same at any world size). Each step: the gradient of the whole
batch, the Gauss-Newton products on its first ``--curvature-batch`` sequences (a sub-batch, as Martens and Grosse's
K-FAC takes its curvature products), ``d = -(G + damping I)^-1 g`` to ``--tolerance`` or ``--cg-iterations``
(with ``--momentum``, ``g`` the gradients' bias-corrected running average, as an optimizer's first moment), and
``p += lr * schedule(step) * d`` with the demo's warm-up and decay. Dropout is off throughout (the curvature must be
a function of the parameters); no weight decay. ``metrics.csv`` is ``pretrain.py``'s, so ``time_to_target.py
compare`` reads it beside the optimizers' runs; ``oracle.json`` adds each step's seconds, products and residuals
(an oracle: its cost per step is the point of reporting it, not a method to ship).
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "bert"))
import gn_oracle  # noqa: E402
import pretrain  # noqa: E402
import recipe  # noqa: E402
import report  # noqa: E402
import run_data  # noqa: E402
from time_to_target import ROOT, build_phase1  # noqa: E402

CONFIG = "configs/bert_cpu_phase2_base.json"


def model_from(phase1: Path, bert: dict[str, Any], vocab_size: int) -> torch.nn.Module:
    """BertForPreTraining with phase 1's weights (its DeepSpeed checkpoint), eager attention (forward-mode AD)."""
    from transformers import BertConfig, BertForPreTraining

    config = json.loads((ROOT / bert["model"]).read_text())
    config.update(vocab_size=vocab_size, max_position_embeddings=max(config.get("max_position_embeddings", 512),
                                                                     bert["max_seq_length"]))  # fmt: skip
    model = BertForPreTraining(BertConfig(**config, attn_implementation="eager"))
    checkpoints = phase1 / "checkpoints"
    tag = (checkpoints / "latest").read_text().strip()
    state = torch.load(checkpoints / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["module"])
    return model.eval()  # no dropout: the curvature is a function of the parameters


def curvature_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> gn_oracle.GaussNewton:
    """The Gauss-Newton matrix of the masked-LM and next-sentence losses on ``batch`` (BERT's loss: the two
    means, summed)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "next_sentence_label")}
    labelled = (batch["labels"] != -100).double()
    weights = (labelled / labelled.sum(), torch.full((len(labelled),), 1.0 / len(labelled), dtype=torch.float64))

    def f(params: dict[str, torch.Tensor]) -> gn_oracle.Outputs:
        out = torch.func.functional_call(model, params, (), inputs)
        return out.prediction_logits, out.seq_relationship_logits

    weights = tuple(w.float() for w in weights)
    return gn_oracle.GaussNewton(f, dict(model.named_parameters()), gn_oracle.cross_entropy_hessian(weights))


def joined(batches: list[dict[str, torch.Tensor]], count: int) -> dict[str, torch.Tensor]:
    """The first ``count`` sequences of ``batches``, padded to one length (padding as the collation pads)."""
    length = max(b["input_ids"].shape[1] for b in batches)
    pad = {"input_ids": 0, "token_type_ids": 0, "attention_mask": 0, "labels": -100}
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if key in pad:
            parts = [torch.nn.functional.pad(t, (0, length - t.shape[1]), value=pad[key]) for t in parts]
        out[key] = torch.cat(parts)[:count]
    return out


def layer_groups(model: torch.nn.Module) -> list[list[str]]:
    """One block per module holding parameters of its own (each Linear, LayerNorm, embedding), a tied parameter
    in the first module holding it (``named_parameters``' name: the decoder's weight is the word embedding's)."""
    names, groups = set(dict(model.named_parameters())), []
    for name, module in model.named_modules():
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        if own := [n for n in own if n in names]:
            groups.append(own)
    return groups


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    phase1 = args.phase1 or build_phase1(args.timeout)
    out = args.out / args.name
    out.mkdir(parents=True, exist_ok=True)
    cli = pretrain.parse_args(["--deepspeed_config", str(ROOT / CONFIG), "--init-checkpoint", str(phase1),
                               "--seed", str(args.seed), "--cache-dir", str(ROOT / "runs" / "bert-cache"),
                               "--loader-workers", "0"])  # fmt: skip
    _, bert = recipe.read_config(cli.deepspeed_config)
    steps = args.steps or bert["max_steps"]
    found = run_data.open_data(cli, bert, cli.cache_dir)
    micro = min(32, args.batch)
    train, order, held_out = found.batches(micro, args.batch // micro)
    batches = found.loader(train, order, 0, steps)
    model = model_from(phase1, bert, found.vocab_size)
    params = dict(model.named_parameters())
    schedule = pretrain.poly_warmup(steps, bert["warmup_proportion"], bert["poly_power"])
    groups = layer_groups(model) if args.layerwise else None
    writer = report.MetricsWriter(out / "metrics.csv")
    records, seconds = [], 0.0
    average: Optional[torch.Tensor] = None
    for step in range(steps):
        started = time.perf_counter()
        micro_batches = [next(batches) for _ in range(args.batch // micro)]
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for batch in micro_batches:
            out_ = model(**batch)
            (out_.loss / len(micro_batches)).backward()
            loss += out_.loss.item() / len(micro_batches)
        curvature = curvature_of(model, joined(micro_batches, args.curvature_batch))
        gradient = curvature.flat({name: p.grad for name, p in params.items()})
        if args.momentum:  # the step solves for the gradients' running average, bias-corrected (Adam's first moment)
            average = gradient * (1 - args.momentum) + (0 if average is None else average * args.momentum)
            gradient = average / (1 - args.momentum ** (step + 1))
        d, solves = gn_oracle.gauss_newton_step(
            curvature, gradient, args.damping, args.cg_iterations, args.tolerance, groups
        )
        with torch.no_grad():
            rate = args.lr * schedule(step)
            for name, delta in curvature.split(d).items():
                params[name].add_(delta, alpha=rate)
        elapsed = time.perf_counter() - started
        seconds += elapsed
        row: dict[str, object] = {"step": step + 1, "samples": (step + 1) * args.batch, "seconds": f"{seconds:.3f}"}
        row.update(loss=f"{loss:.6f}", lr=f"{rate:.6g}", data_seconds="0")
        reached = False
        if (step + 1) % (args.eval_every or bert["eval_every"]) == 0 or step + 1 == steps:
            mlm, accuracy = pretrain.evaluate(model, held_out)
            model.eval()  # evaluate() leaves the model in train mode
            row.update(held_out_mlm_loss=f"{mlm:.6f}", held_out_mlm_accuracy=f"{accuracy:.6f}")
            reached = args.stop_at is not None and mlm <= args.stop_at
        writer.write(row)
        solved = {"iterations": [s.iterations for s in solves], "residuals": [s.residual for s in solves]}
        records.append({"step": step + 1, "seconds": elapsed, "products": curvature.products, **solved})
        print(json.dumps({**row, "products": curvature.products}), flush=True)
        if reached:
            break
    del batches
    dist.destroy_process_group()
    result = {
        "command": "python benchmarks/gn_oracle_bert.py " + " ".join(args.argv),
        "settings": {key: value for key, value in vars(args).items() if key not in ("out", "argv", "phase1")},
        "phase1": phase1.name,
        "median_step_seconds": statistics.median(r["seconds"] for r in records),
        "steps": records,
    }
    (out / "oracle.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    go = sub.add_parser("run", help="train phase 2 by the oracle's steps")
    go.add_argument("--batch", type=int, default=256, help="global batch (micro-batches of 32)")
    go.add_argument("--damping", type=float, default=1e-2)
    go.add_argument("--lr", type=float, default=1.0, help="the step's scale at the schedule's peak")
    go.add_argument("--momentum", type=float, default=0.0, help="solve for the gradients' running average at this "
                    "decay (0: the batch's own gradient)")  # fmt: skip
    go.add_argument("--layerwise", action="store_true", help="block-diagonal: each module's block alone")
    go.add_argument("--curvature-batch", type=int, default=64, help="sequences the products are taken on")
    go.add_argument("--cg-iterations", type=int, default=10)
    go.add_argument("--tolerance", type=float, default=1e-3, help="CG's relative residual")
    go.add_argument("--steps", type=int, help="default: the config's bert.max_steps (the schedule's length)")
    go.add_argument("--eval-every", type=int, help="held-out loss every this many steps (default: the config's)")
    go.add_argument("--stop-at", type=float, help="stop once the held-out masked-LM loss is at or below this")
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--threads", type=int, default=2)
    go.add_argument("--port", type=int, default=29533)
    go.add_argument("--phase1", type=Path, help="a phase-1 run directory (default: the demo's, built once)")
    go.add_argument("--timeout", type=float, default=3600.0, help="phase 1's build, when it is not there")
    go.add_argument("--out", type=Path, default=ROOT / "runs" / "gn_oracle")
    go.add_argument("--name", help="default: from the settings")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    kind = "layerwise" if args.layerwise else "whole"
    momentum = f"-m{args.momentum:g}" if args.momentum else ""
    args.name = args.name or f"{kind}-b{args.batch}-d{args.damping:g}-lr{args.lr:g}{momentum}-seed{args.seed}"
    print(json.dumps({k: v for k, v in run(args).items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
