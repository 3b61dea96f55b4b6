"""The BERT example's data at the scale users hold it: what a launch and a resume read before step 1 and what a rank
holds, against the corpus's size; preparation of every text layout; phase 2's shards from phase 1's tokens; and
NVIDIA's files, read a file ahead, against the synchronous reading. Built on ``bert_data.py``'s corpus generator,
process-tree watcher and launches::

    python benchmarks/bert_data_scale.py run [--sizes 200 2048] [--repeats 4] [--layouts lines jsonl] \\
        [--baseline-tree ../before] [--out runs/bert_data_scale]

* ``launches``: for each size, the demo's K-FAC arm for 20 steps on the prepared corpus, the sizes alternating,
  ``--repeats`` each, then each run stopped at step 10 and resumed: per rank, the bytes read (``/proc/self/io``'s
  ``rchar``) and the seconds from the launcher's start by its first step, at launch and at ``--resume``, and its
  resident memory after step 20. The shards were prepared (and stamped) before, as a user's are.
* ``layouts``: the largest size generated again one document per line and as JSON lines, each prepared with 2
  workers: peak memory of the process tree and wall seconds, beside the blank-line corpus's.
* ``phase2``: the smallest corpus's shards paired again at sequence length 128 (``prepare.py --from-shards``)
  against a full preparation of its text at 128 with phase 1's tokenizer: wall seconds of each.
* ``nvidia`` (``--baseline-tree``: a checkout before the files were read ahead, e.g. ``git worktree add ../before
  db5387b``): ``--nvidia-files`` HDF5 files of ``--nvidia-rows`` rows at sequence length 128 in NVIDIA's layout
  (random ids, static masks), trained for enough steps to cross two file switches by this tree and by the baseline,
  alternating: the share of each step spent waiting on data.
* ``demo``: the demo's two arms on the embedded corpus for ``--demo-steps`` steps at each of ``--demo-seeds``, by
  this tree and by ``--baseline-tree``: each step's training loss, equal where both trees gave the same batches.

The JSON goes to ``benchmarks/results/bert_data_scale.json``, each part with the command that measured it, so parts
can be measured in separate runs into one file; nothing absolute in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
from bert_data import CONFIG, ROOT, generate, prepare_corpus, train, watched
from time_to_target import portable

RESULT = ROOT / "benchmarks" / "results" / "bert_data_scale.json"
NVIDIA_SEQ, NVIDIA_PREDICTIONS = 128, 20
PARTS = ["launches", "layouts", "phase2", "nvidia", "demo"]


def _config(out: Path, name: str, **bert: Any) -> str:
    """The demo's K-FAC config with ``bert`` keys set, written under ``out``; its path."""
    config = json.loads((ROOT / CONFIG).read_text())
    config["bert"].update(bert)
    path = out / name
    path.write_text(json.dumps(config, indent=1))
    return str(path)


def launches(out: Path, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Launch and resume figures per size (see the module docstring)."""
    runs: dict[str, list[dict[str, Any]]] = {f"{mb}mb": [] for mb in sizes}
    # one launch not counted: a first launch may build DeepSpeed's extensions and finds the page cache cold
    warm_up = train(ROOT, ["--shards", str(out / f"shards-{min(sizes)}mb")], out / "warm_up", "warm_up", None, 15, 2)
    resumes: dict[str, list[dict[str, Any]]] = {f"{mb}mb": [] for mb in sizes}
    for repeat in range(repeats):
        for mb in sizes if repeat % 2 == 0 else reversed(sizes):
            data = ["--shards", str(out / f"shards-{mb}mb")]
            name = f"{mb}mb-{repeat}"
            runs[f"{mb}mb"].append(train(ROOT, data, out / "train", name, None, 15))
            train(ROOT, data + ["--stop-after", "10"], out / "resume", name, None, 15)
            resumes[f"{mb}mb"].append(train(ROOT, data + ["--resume"], out / "resume", name, None, 15))
            print(f"launch {name}: {json.dumps(runs[f'{mb}mb'][-1])}", flush=True)
    small, large = f"{min(sizes)}mb", f"{max(sizes)}mb"

    def median(records: list[dict], key: str, pick: Any = max, over: Any = statistics.median) -> float:
        return over(pick(r[key]) for r in records if key in r)

    def ratio(records: dict[str, list[dict]], key: str, pick: Any = max, over: Any = statistics.median) -> float:
        """The largest corpus's figure over the smallest's: ``pick`` over the ranks, ``over`` the repeats."""
        return median(records[large], key, pick, over) / median(records[small], key, pick, over)

    def rank_rss(values: list[dict]) -> float:
        return max(v["rank"] for v in values if v)

    return {
        "warm_up": warm_up,
        "runs": runs,
        "resumes": resumes,
        "figures": {
            "read_bytes_before_step_1_ratio": ratio(runs, "read_bytes_at_first_step"),
            "read_bytes_before_step_1_ratio_at_resume": ratio(resumes, "read_bytes_at_first_step"),
            "first_step_seconds_ratio": ratio(runs, "first_step_seconds"),
            "first_step_seconds_ratio_at_resume": ratio(resumes, "first_step_seconds"),
            "first_step_seconds_ratio_of_fastest": ratio(runs, "first_step_seconds", max, min),
            "first_step_seconds_ratio_of_fastest_at_resume": ratio(resumes, "first_step_seconds", max, min),
            "rank_resident_after_20_ratio": ratio(runs, "resident_bytes_after_20", rank_rss),
            "read_bytes_before_step_1": {s: median(runs[s], "read_bytes_at_first_step") for s in runs},
        },
    }


def layouts(out: Path, size: int, names: list[str], workers: int, cache: Path) -> dict[str, Any]:
    """The largest size in each layout, prepared: peak memory and seconds (blank-line figures from ``run``)."""
    found = {}
    for layout in names:
        corpus = out / f"corpus-{size}mb-{layout}"
        generate(corpus, size, 0, cache, layout)
        shards = out / f"shards-{size}mb-{layout}"
        subprocess.run(["rm", "-rf", str(shards)], check=True)
        found[layout] = prepare_corpus(corpus, shards, out / f"prepare-{layout}.log", workers, "--layout", layout)
        print(f"layout {layout}: {json.dumps(found[layout])}", flush=True)
    return found


def phase2(out: Path, size: int, workers: int) -> dict[str, Any]:
    """Phase 2's shards at sequence length 128 from phase 1's tokens, against a full preparation of the text."""
    config = _config(out, "phase2.json", max_seq_length=128)
    phase1 = out / f"shards-{size}mb"
    common = ["--deepspeed_config", config, "--workers", str(workers)]
    found = {}
    for name, args in {
        "from_shards": ["--from-shards", str(phase1)],
        "full": ["--text-dir", str(out / f"corpus-{size}mb"), "--tokenizer", str(phase1 / "tokenizer")],
    }.items():
        shards = out / f"phase2-{name}"
        subprocess.run(["rm", "-rf", str(shards)], check=True)
        cmd = [sys.executable, "examples/bert/prepare.py", *args, *common, "--out", str(shards)]
        found[name] = watched(cmd, out / f"phase2-{name}.log")
    found["speed_up"] = found["full"]["seconds"] / found["from_shards"]["seconds"]
    return found


def nvidia_files(out: Path, files: int, rows: int, seed: int = 0) -> Path:
    """``files`` HDF5 training files and a test file in NVIDIA's layout (dtypes, shapes, gzip), random ids."""
    import h5py

    root = out / f"nvidia-{files}x{rows}"
    if (root / "complete").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in [f"wiki_training_{i}.hdf5" for i in range(files)] + ["wiki_test_0.hdf5"]:
        count = rows if "training" in name else 2048
        ids = rng.integers(5, 1024, size=(count, NVIDIA_SEQ), dtype=np.int32)
        positions = np.sort(rng.choice(np.arange(1, NVIDIA_SEQ - 1), NVIDIA_PREDICTIONS, replace=False))
        arrays = {
            "input_ids": ids,
            "input_mask": np.ones((count, NVIDIA_SEQ), np.int8),
            "segment_ids": (np.arange(NVIDIA_SEQ) >= NVIDIA_SEQ // 2).astype(np.int8)[None].repeat(count, 0),
            "masked_lm_positions": np.broadcast_to(positions, (count, NVIDIA_PREDICTIONS)).astype(np.int32),
            "masked_lm_ids": ids[:, positions],
            "next_sentence_labels": rng.integers(0, 2, size=count).astype(np.int8),
        }
        with h5py.File(root / name, "w") as f:
            for key, value in arrays.items():
                f.create_dataset(key, data=value, compression="gzip")
    (root / "complete").write_text("")
    return root


def nvidia(out: Path, files: int, rows: int, repeats: int, baseline: Optional[Path]) -> dict[str, Any]:
    """The share of a step spent waiting on data across file switches, this tree against ``baseline``."""
    root = nvidia_files(out, files, rows)
    config = _config(out, "nvidia.json", max_seq_length=NVIDIA_SEQ)
    micro, accum = 32, json.loads((ROOT / CONFIG).read_text())["gradient_accumulation_steps"]
    steps = int(2.2 * rows / micro / accum)  # past two file switches on every rank
    trees = {"ahead": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for repeat in range(repeats):
        for name, tree in trees.items() if repeat % 2 == 0 else reversed(trees.items()):
            record = train(tree, ["--nvidia-hdf5", str(root)], out / "nvidia", f"{name}-{repeat}", None, 60, steps,
                           config)  # fmt: skip
            runs[name].append(record)
            print(f"nvidia {name} #{repeat}: {json.dumps(record)}", flush=True)
    waits = {
        name: [max(r["data_wait_fraction"]) for r in done if "data_wait_fraction" in r] for name, done in runs.items()
    }
    return {"steps": steps, "runs": runs, "data_wait_fraction": waits}


def demo(out: Path, seeds: list[int], steps: int, baseline: Optional[Path]) -> dict[str, Any]:
    """The demo's two arms on the embedded corpus, ``steps`` steps a seed, by this tree and by ``baseline``: each
    step's training loss, which is the same in both where the data path gave the same batches (so the demo's
    ratio is), and the median step's seconds (the trees alternating)."""
    import csv

    trees = {"now": ROOT, **({"baseline": baseline.resolve()} if baseline else {})}
    arms = {"base": "configs/bert_cpu_phase2_base.json", "kfac": CONFIG}
    losses: dict[str, dict[str, list[float]]] = {}
    steps_seconds: dict[str, dict[str, float]] = {}
    for seed in seeds:
        for arm, config in arms.items():
            for name, tree in list(trees.items())[:: 1 if seed % 2 == 0 else -1]:  # alternating
                run_name = f"{name}-{arm}-seed{seed}"
                record = train(tree, ["--seed", str(seed)], out / "demo", run_name, None, 15, steps, config)
                with (out / "demo" / run_name / "metrics.csv").open() as f:
                    rows = list(csv.DictReader(f))
                losses.setdefault(f"{arm}-seed{seed}", {})[name] = [float(r["loss"]) for r in rows]
                ends = [float(r["seconds"]) for r in rows]
                steps_seconds.setdefault(f"{arm}-seed{seed}", {})[name] = statistics.median(
                    b - a for a, b in zip(ends[1:], ends[2:])
                )  # steps 3 on: past the first decompositions
                print(f"demo {run_name}: exit {record['exit']}", flush=True)
    differences = {
        key: max(abs(a - b) for a, b in zip(runs["now"], runs["baseline"])) if "baseline" in runs else None
        for key, runs in losses.items()
    }
    return {
        "steps": steps,
        "losses": losses,
        "max_abs_loss_difference": differences,
        "median_step_seconds": steps_seconds,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = ROOT / "runs" / "bert-cache" / "corpus-cache"
    command = "python benchmarks/bert_data_scale.py run " + " ".join(args.argv)
    result: dict[str, Any] = json.loads(args.result.read_text()) if args.result.is_file() else {}
    result.update(config=CONFIG, versions={"python": platform.python_version(), "cpus": os.cpu_count()})
    result.setdefault("prepare", {})
    for mb in args.sizes:
        corpus, shards = out / f"corpus-{mb}mb", out / f"shards-{mb}mb"
        generate(corpus, mb, 0, cache)
        if not (shards / "manifest.json").is_file():
            result["prepare"][str(mb)] = prepare_corpus(corpus, shards, out / f"prepare-{mb}mb.log", args.workers)
    measure = {
        "launches": lambda: launches(out, args.sizes, args.repeats),
        "layouts": lambda: layouts(out, max(args.sizes), args.layouts, args.workers, cache),
        "phase2": lambda: phase2(out, min(args.sizes), args.workers),
        "nvidia": lambda: nvidia(out, args.nvidia_files, args.nvidia_rows, args.repeats, args.baseline_tree),
        "demo": lambda: demo(out, args.demo_seeds, args.demo_steps, args.baseline_tree),
    }
    for part in args.parts:
        started = time.time()
        measured = measure[part]()
        if part == "layouts":  # one layout a run may add to those measured before
            measured = {
                **{k: v for k, v in result.get(part, {}).items() if k not in ("command", "seconds")},
                **measured,
            }
        result[part] = {**measured, "command": command, "seconds": time.time() - started}
        args.result.write_text(json.dumps(portable(result), indent=1) + "\n")
    return portable(result)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    go = sub.add_parser("run", help="the measurements")
    go.add_argument("--sizes", type=int, nargs="+", default=[200, 2048], help="MB of text of each generated corpus")
    go.add_argument("--repeats", type=int, default=2, help="runs per arm, alternating")
    go.add_argument("--layouts", nargs="*", default=["lines", "jsonl"], help="layouts prepared at the largest size")
    go.add_argument("--workers", type=int, default=2)
    go.add_argument("--nvidia-files", type=int, default=3, help="NVIDIA training files (0: none)")
    go.add_argument("--nvidia-rows", type=int, default=20_000, help="rows a file (NVIDIA's hold about 100k)")
    go.add_argument("--baseline-tree", type=Path, help="a checkout reading NVIDIA's files synchronously")
    go.add_argument("--demo-seeds", type=int, nargs="+", default=[0, 1, 2])
    go.add_argument("--demo-steps", type=int, default=10, help="steps of each demo arm, by each tree")
    go.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="the measurements to make")
    go.add_argument("--out", type=Path, default=ROOT / "runs" / "bert_data_scale")
    go.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    args.argv = sys.argv[2:] if argv is None else argv[1:]
    result = run(args)
    print(json.dumps({part: result[part].get("figures") for part in PARTS if part in result}, indent=1))


if __name__ == "__main__":
    main()
