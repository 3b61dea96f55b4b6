"""Size ladder: does K-FAC's gain over tuned AdamW on BERT phase 2 hold as the model grows?

Per size, the demo's recipe with only the model changed (``configs/bert/bert-<size>.json``; sequence 64,
vocabulary 1,024, global batch 256 on 2 ranks, all as the demo): phase 1 with LAMB
(``configs/bert_cpu_phase1_lamb.json``, ``--phase1-steps`` per size, the demo's 1,500 by default, trained once by
``examples/bert/phase1.py`` and reused by its key), then phase 2 from that checkpoint with the peers benchmark's arms (AdamW's
``configs/bert_cpu_phase2_base.json`` and ds_kfac's ``configs/bert_cpu_phase2_kfac.json``, each rate set with
``--set ARM:KEY=JSON`` as its per-size grid chose), alternating per seed::

    python benchmarks/ladder.py run 4x256 --seeds 0                     # phase 1 (once), then AdamW and ds_kfac
    python benchmarks/ladder.py run 4x256 --arms adamw --set adamw:optimizer.params.lr=0.004 --name ladder_4x256_adamw_lr004
    python benchmarks/ladder.py report benchmarks/results/ladder/ladder_*.json   # ladder.json and its plot

``run`` writes ``<out>/<name>.json`` (the peers benchmark's summary, the size's parameter counts and the
phase-1 run's curve) and its plot; ``report`` reads such files (several per size: its rate grid, each arm taken at
its grid's best) and writes ``ladder.json`` with K-FAC's steps and training seconds to AdamW's median final per
size, and ``ladder.png`` (the ratio against the encoder's parameter count).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).parent))
import peers  # noqa: E402
import time_to_target as ttt  # noqa: E402

ROOT = ttt.ROOT
SIZES = {
    "2x128": "configs/bert/bert-tiny.json",
    "2x256": "configs/bert/bert-2x256.json",
    "4x256": "configs/bert/bert-4x256.json",
    "4x384": "configs/bert/bert-4x384.json",
}
"""Ladder size (layers x hidden) -> model config; 2x128 is the demo's."""
BASE = "adamw"


def parameter_counts(model_config: str, vocab: int) -> dict[str, int]:
    """The size's parameters: the encoder's (its layers), and all (embeddings, heads) at ``vocab`` tokens."""
    from transformers import BertConfig, BertForPreTraining

    settings = json.loads((ROOT / model_config).read_text())
    model = BertForPreTraining(BertConfig(**{**settings, "vocab_size": vocab}))
    return {
        "encoder": sum(p.numel() for p in model.bert.encoder.parameters()),
        "total": sum(p.numel() for p in model.parameters()),
    }


def phase1(size: str, steps: int, timeout: float, out: Path) -> tuple[Path, dict[str, Any]]:
    """The size's phase-1 run directory (trained once) and the LAMB config that trained it: the demo's own file
    where nothing changes (so the demo's phase 1 is reused), else a copy with the model and steps set."""
    demo = ROOT / "configs/bert_cpu_phase1_lamb.json"
    base = json.loads(demo.read_text())
    config = ttt.apply_overrides(base, [f"bert.model={json.dumps(SIZES[size])}", f"bert.max_steps={steps}"])
    path = demo
    if config != base:
        path = out / "configs" / f"phase1-{size}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
    return ttt.build_phase1(timeout, path), config


def phase1_curve(run: Path) -> list[tuple[int, float]]:
    """Phase 1's (step, training loss) at every step: where its plateau lies."""
    with (run / "metrics.csv").open(newline="") as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out
    if args.phase1 is None:
        directory, phase1_config = phase1(args.size, args.phase1_steps, args.timeout, out)
    else:  # a phase-1 run of this size trained before (the demo's, under an older key of examples/bert/phase1.py)
        directory, phase1_config = args.phase1, None
    arms = {arm: peers.ARMS["bert"][arm] for arm in args.arms}
    sets = peers.parse_sets(args.set, list(arms))
    model = [f"bert.model={json.dumps(SIZES[args.size])}"]
    configs = {
        arm: ttt.apply_overrides(json.loads((ROOT / path).read_text()), model + sets[arm]) for arm, path in arms.items()
    }
    name = args.name or f"ladder_{args.size}"
    labels = {arm: f"{arm} ({Path(path).stem}), BERT {args.size}" for arm, path in arms.items()}
    runs = peers.run_arms("bert", configs, labels, args.seeds, out / name, [], args.timeout, directory)
    summary = peers.summarize({arm: [r["curve"] for r in runs if r["arm"] == arm] for arm in arms}, False)
    result = {
        "task": "bert",
        "size": args.size,
        "model": SIZES[args.size],
        "parameters": parameter_counts(SIZES[args.size], configs[args.arms[0]]["bert"]["vocab_size"]),
        "command": shlex.join(["python", "benchmarks/ladder.py", *sys.argv[1:]]),
        "settings": {
            "world": 2,
            "seeds": args.seeds,
            "metric": "held_out_mlm_loss",
            "higher_is_better": False,
            "arms": arms,
            "set": args.set,
            "phase1": {"steps": args.phase1_steps, "directory": directory.name, "config": phase1_config},
        },
        "configs": configs,
        "versions": ttt.versions(),
        "phase1_curve": phase1_curve(directory),
        "runs": runs,
        "summary": summary,
    }
    target = summary[BASE]["median_final"] if BASE in summary else None
    peers.save(result, out / name, f"BERT {args.size} phase 2, {len(args.seeds)} seed(s), 2 ranks", target)
    print(peers.table(result))
    return result


def report(paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """One row per size, the ratio against the encoder's size. A size may have several files (its rate grid): each
    arm is taken from the file where its median final is lowest (its grid's choice), and the two chosen arms' curves
    are compared afresh; ``side_by_side`` says whether both came from one run (else their seconds ran apart)."""
    grids: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path in paths:
        result = json.loads(path.read_text())
        grids.setdefault(result["size"], []).append((path, result))
    rows = []
    for size, grid in grids.items():
        finals = {
            arm: {path: r["summary"][arm]["median_final"] for path, r in grid if arm in r["summary"]}
            for arm in (BASE, peers.KFAC)
        }
        for arm, held in finals.items():
            if not held:
                raise SystemExit(f"ladder report: no file of size {size} has the arm {arm!r}")
        results = dict(grid)
        best = {arm: min(held, key=held.__getitem__) for arm, held in finals.items()}  # the file of its lowest final
        curves = {arm: [r["curve"] for r in results[path]["runs"] if r["arm"] == arm] for arm, path in best.items()}
        summary = peers.summarize(curves, False)
        r = peers.ratios(summary, peers.KFAC, BASE)  # to AdamW's median final, over AdamW's full budget
        rows.append(
            {
                "size": size,
                "files": {arm: path.name for arm, path in best.items()},
                "side_by_side": best[BASE] == best[peers.KFAC],
                "grid": {arm: {path.name: final for path, final in held.items()} for arm, held in finals.items()},
                "commands": {arm: results[path]["command"] for arm, path in best.items()},
                "seeds": {arm: results[path]["settings"]["seeds"] for arm, path in best.items()},
                "parameters": results[best[BASE]]["parameters"],
                "adamw_final": summary[BASE]["median_final"],
                "kfac_final": summary[peers.KFAC]["median_final"],
                "kfac_to_adamw_final": summary[peers.KFAC]["to"][BASE],
                "steps_ratio": r["steps"],
                "seconds_ratio": r["seconds"],
                "seconds_per_step": {arm: summary[arm]["seconds_per_step"] for arm in summary},
            }
        )
    rows.sort(key=lambda row: row["parameters"]["encoder"])
    result = {"command": shlex.join(["python", "benchmarks/ladder.py", *sys.argv[1:]]), "sizes": rows}
    out.mkdir(parents=True, exist_ok=True)
    result = ttt.portable(result)
    (out / "ladder.json").write_text(json.dumps(result, indent=1))
    _plot(rows, out / "ladder.png")
    for row in rows:
        apart = "" if row["side_by_side"] else " (the arms' best rates ran apart: seconds not side by side)"
        print(
            f"{row['size']}: encoder {row['parameters']['encoder']:,} parameters: AdamW {row['adamw_final']:.4f} "
            f"({row['files'][BASE]}), ds_kfac {row['kfac_final']:.4f} ({row['files'][peers.KFAC]}); ds_kfac reaches "
            f"AdamW's final in {peers._fmt(row['steps_ratio'], '.2f')}x its steps, "
            f"{peers._fmt(row['seconds_ratio'], '.2f')}x its seconds{apart}"
        )
    return result


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("steps_ratio", "steps"), ("seconds_ratio", "training seconds (arms side by side)")):
        shown = [r for r in rows if r[key] is not None and (key == "steps_ratio" or r["side_by_side"])]
        ax.plot([r["parameters"]["encoder"] for r in shown], [r[key] for r in shown], marker="o", label=label)
        for row in shown:
            ax.annotate(row["size"], (row["parameters"]["encoder"], row[key]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("encoder parameters")
    ax.set_ylabel("ds_kfac / AdamW to AdamW's final")
    ax.set_title("BERT phase 2: K-FAC's gain over tuned AdamW by size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one size: phase 1 (once), then the arms side by side")
    r.add_argument("size", choices=sorted(SIZES))
    r.add_argument("--arms", nargs="+", default=[BASE, peers.KFAC], choices=sorted(peers.ARMS["bert"]))
    r.add_argument("--set", action="append", default=[], metavar="ARM:KEY=JSON", help="override in an arm")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--phase1-steps", type=int, default=1500, help="phase 1's LAMB steps at this size")
    r.add_argument("--phase1", type=Path, help="a phase-1 run directory of this size to start from (default: trained)")
    r.add_argument("--name", help="the result's file name (default: ladder_<size>)")
    r.add_argument("--out", type=Path, default=ROOT / "runs" / "ladder")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p = sub.add_parser("report", help="ladder.json and ladder.png from the runs' JSON (each arm at its grid's best)")
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ladder")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    else:
        report(args.results, args.out)


if __name__ == "__main__":
    main()
