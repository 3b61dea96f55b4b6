"""The BERT example's data path at corpus scale: preparation, and training ranks on a 2 GB corpus against the
embedded one (issue 60's targets), with the earlier in-memory path measured on the same corpus.

    python benchmarks/bert_data.py generate --mb 2048 --out runs/bert_data/corpus-2048mb
    python benchmarks/bert_data.py run [--sizes 200 2048] [--today-tree ../today] [--out runs/bert_data]

``generate`` writes a corpus offline, deterministic for ``--seed``, from the embedded "packages" corpus's sentences
(``examples/bert/data.py``: docstrings of the standard library and the pinned dependencies): each document joins
the sentences of 1 to 4 of its documents drawn at random (so continuations stay within what was one document),
one sentence per line, documents separated by a blank line, in ``part-NNNNN.txt`` files of about 100 MB.

``run`` generates the corpora it lacks, then:

* prepares each (``examples/bert/prepare.py --workers 2``, the CPU demo's config: sequence length 64, a
  1,024-token vocabulary trained on a 128 MB sample), sampling every 0.2 s the memory of the whole process tree
  (the sum of its processes' resident memory, and of their proportional set sizes, which count shared pages once);
  its throughput is the corpus's MB of text over the command's wall time;
* prepares the embedded corpus with the same config, then trains ``examples/bert/pretrain.py`` for 20 steps of
  ``configs/bert_cpu_phase2_kfac.json`` (the demo's K-FAC arm, 2 ranks through the ``deepspeed`` launcher) on it
  and on the largest generated corpus, alternating, ``--repeats`` times each: the time from the launcher's start to
  each rank's first completed step, each rank's resident memory (and its loader worker's) after step 20, and the
  seconds its steps waited on data (``ranks/rank-<r>.json``, ``metrics.csv``);
* with ``--today-tree`` (a checkout of the commit before the shards, e.g. ``git worktree add ../today 0a65d80``),
  runs that tree's ``pretrain.py --text-dir`` on the same corpus for 20 steps, its process tree's memory watched:
  stopped when it holds more than ``--today-cap-gb`` or runs past ``--today-minutes`` without a step.

The JSON goes to ``benchmarks/results/bert_data.json`` (with the command), nothing absolute in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "bert"))
CONFIG = "configs/bert_cpu_phase2_kfac.json"
RESULT = ROOT / "benchmarks" / "results" / "bert_data.json"
PART_BYTES = 100_000_000


# --------------------------------------------------------------------------- the corpus


def generate(out: Path, megabytes: float, seed: int, cache: Path, layout: str = "blank-lines") -> dict[str, Any]:
    """Write a corpus of ``megabytes`` MB of text (see the module docstring) in ``layout`` (``lines``: a document's
    sentences on one line; ``jsonl``: that line as ``{"text": ...}``); its record (also ``corpus.json``)."""
    import corpora

    record_file = out / "corpus.json"
    wanted = {"megabytes": megabytes, "seed": seed, "from": "packages"}
    wanted |= {"layout": layout} if layout != "blank-lines" else {}
    suffix = "jsonl" if layout == "jsonl" else "txt"
    if (
        record_file.is_file()
        and {k: v for k, v in json.loads(record_file.read_text()).items() if k in wanted} == wanted
    ):
        return json.loads(record_file.read_text())
    documents = corpora.embedded_corpus("packages", cache_dir=cache)
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("part-*.*"):
        stale.unlink()
    target, written, part, count = int(megabytes * 1e6), 0, 0, 0
    file = (out / f"part-{part:05d}.{suffix}").open("w", encoding="utf-8")
    while written < target:
        picked = [documents[rng.randrange(len(documents))] for _ in range(rng.randint(1, 4))]
        sentences = [s for doc in picked for s in doc]
        if layout == "blank-lines":
            text = "\n".join(sentences) + "\n\n"
        else:
            line = " ".join(sentences)
            text = (json.dumps({"text": line}) if layout == "jsonl" else line) + "\n"
        file.write(text)
        size = len(text.encode("utf-8"))
        written, count = written + size, count + 1
        if file.tell() >= PART_BYTES and written < target:
            file.close()
            part += 1
            file = (out / f"part-{part:05d}.{suffix}").open("w", encoding="utf-8")
    file.close()
    record = {**wanted, "bytes": written, "documents": count, "files": part + 1}
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    return record


# --------------------------------------------------------------------------- watching a process tree


def _tree(root: int) -> list[int]:
    """``root`` and every process descending from it."""
    parents: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            parents[int(status.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return found


def _kilobytes(pid: int, file: str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeMemory(threading.Thread):
    """Samples a process tree's memory every ``interval`` seconds: the peak of its processes' summed resident
    memory and of their summed proportional set sizes (in bytes)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_pss = self.rss = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            pids = _tree(self.pid)
            self.rss = 1024 * sum(_kilobytes(p, "status", "VmRSS") for p in pids)
            pss = 1024 * sum(_kilobytes(p, "smaps_rollup", "Pss") for p in pids)
            self.peak_rss, self.peak_pss = max(self.peak_rss, self.rss), max(self.peak_pss, pss)
            self.done.wait(self.interval)


def watched(
    cmd: list[str], log: Path, cap_bytes: Optional[int] = None, minutes: Optional[float] = None, tree: Path = ROOT
) -> dict:
    """Run ``cmd`` (its output to ``log``; ``ds_kfac`` imported from ``tree``) watching its process tree's memory;
    stopped (the whole tree killed) past ``cap_bytes`` or ``minutes``. Its exit code, wall seconds, peaks and why
    it was stopped."""
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": extensions, "PYTHONPATH": str(tree)}
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    memory = TreeMemory(proc.pid)
    memory.start()
    stopped = None
    while proc.poll() is None:
        time.sleep(0.2)
        if cap_bytes is not None and memory.rss > cap_bytes:
            stopped = f"held {memory.rss / 2**30:.1f} GiB (over the {cap_bytes / 2**30:.0f} GiB cap)"
        elif minutes is not None and time.time() - started > 60 * minutes:
            stopped = f"ran {minutes:.0f} minutes"
        if stopped:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    memory.done.set()
    memory.join()
    return {
        "exit": proc.returncode,
        "seconds": time.time() - started,
        "started_unix": started,
        "peak_rss_bytes": memory.peak_rss,
        "peak_pss_bytes": memory.peak_pss,
        "stopped": stopped,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _release(port: int) -> None:
    """DeepSpeed's CPU shared-memory segments of the launch on ``port`` (a killed rank cannot remove its own)."""
    sys.path.insert(0, str(ROOT))
    from ds_kfac.integration.cleanup import release_port_segments

    release_port_segments(port)


# --------------------------------------------------------------------------- the measurements


def prepare_corpus(corpus: Path, shards: Path, log: Path, workers: int, *extra: str) -> dict[str, Any]:
    """``prepare.py`` on a text corpus (``extra``: its other flags) with its memory watched; the figures."""
    cmd = [sys.executable, "examples/bert/prepare.py", "--text-dir", str(corpus), "--deepspeed_config", CONFIG]
    cmd += ["--out", str(shards), "--workers", str(workers), *extra]
    result = watched(cmd, log)
    text = json.loads((corpus / "corpus.json").read_text())["bytes"]
    manifest = json.loads((shards / "manifest.json").read_text()) if result["exit"] == 0 else {}
    return {
        **result,
        "text_bytes": text,
        "mb_per_second": text / 1e6 / result["seconds"],
        "totals": manifest.get("totals"),
        "shard_bytes": sum(size for s in manifest.get("shards", []) for size in s["files"].values()),
    }


def train(
    tree: Path,
    data_args: list[str],
    out: Path,
    name: str,
    cap: Optional[int],
    minutes: Optional[float],
    steps: int = 20,
    config: str = CONFIG,
) -> dict:
    """``steps`` (20) of the demo's K-FAC arm (``config``) on 2 ranks from ``tree``'s ``pretrain.py`` (``data_args``
    may add ``--resume``, ``--stop-after``); launch-to-step, what each rank read by then, memory, waits."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(port)]
    cmd += [str(tree / "examples/bert/pretrain.py"), "--deepspeed_config", str(ROOT / config), *data_args]
    cmd += ["--output-dir", str(out), "--run-name", name, "--max-steps", str(steps), "--eval-every", "0"]
    try:
        result = watched(cmd, out / f"{name}.log", cap, minutes, tree)
    finally:
        _release(port)
    run = out / name
    ranks = [json.loads(p.read_text()) for p in sorted((run / "ranks").glob("rank-*.json"))]
    if ranks:
        result["first_step_seconds"] = [r["first_step_unix"] - result["started_unix"] for r in ranks]
        result["read_bytes_at_first_step"] = [r.get("read_bytes_at_first_step") for r in ranks]
        result["resident_bytes_after_20"] = [r["resident_bytes"].get("20") for r in ranks]
        result["data_wait_fraction"] = [r["data_wait_seconds"] / r["step_seconds"] for r in ranks]
        import csv

        with (run / "metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        later = [(float(r["data_seconds"]), float(r["seconds"])) for r in rows[1:]]
        steps = [b - a for (_, a), (_, b) in zip([(0.0, float(rows[0]["seconds"]))] + later, later)]
        result["rank0_steps_2_to_20"] = {
            "data_wait_fraction": sum(w for w, _ in later) / sum(steps),
            "median_step_seconds": statistics.median(steps),
            "median_data_wait_seconds": statistics.median(w for w, _ in later),
        }
    return result


PROBE = """
import json, random, sys
import numpy as np
sys.path.insert(0, "examples/bert")
import shards
root, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
opened = shards.ShardSet.open(root)
maps = {}
def mapped(split, index):  # the same pair read from np.load(mmap_mode="r") arrays
    starts = opened.starts[split]
    shard = int(np.searchsorted(starts, index, side="right")) - 1
    for f in ("tokens.npy", shards.SPLITS[split]):
        maps.setdefault((shard, f), np.load(opened.root / opened.names[shard] / f, mmap_mode="r"))
    row = maps[shard, shards.SPLITS[split]][index - starts[shard]]
    tokens = maps[shard, "tokens.npy"]
    return tokens[row["a_start"] : row["a_start"] + row["a_length"]].sum() + tokens[row["b_start"]].sum()
rng = random.Random(0)
for _ in range(count):
    index = rng.randrange(len(opened))
    mapped("train", index) if mode == "mmap" else opened.example("train", index, 2, 3)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "RssAnon", "RssFile")))
print(json.dumps({key: int(value.split()[0]) * 1024 for key, value in status.items()}))
"""


def access_probe(root: Path, count: int = 8000) -> dict[str, dict[str, int]]:
    """A process's resident memory after reading ``count`` random training pairs of the shards under ``root``,
    memory-mapped (``np.load(mmap_mode="r")``) and as ``ShardSet`` reads them (``pread``)."""
    found = {}
    for mode in ("mmap", "pread"):
        out = subprocess.run([sys.executable, "-c", PROBE, str(root), mode, str(count)], cwd=ROOT, capture_output=True)
        found[mode] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return found


def _ratio(new: list[float], base: list[float]) -> float:
    return statistics.median(new) / statistics.median(base)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = ROOT / "runs" / "bert-cache" / "corpus-cache"
    corpora = {mb: out / f"corpus-{mb}mb" for mb in args.sizes}
    result: dict[str, Any] = {
        "command": "python benchmarks/bert_data.py run " + " ".join(args.argv),
        "config": CONFIG,
        "versions": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "corpora": {},
        "prepare": {},
    }
    for mb, corpus in corpora.items():
        result["corpora"][mb] = generate(corpus, mb, args.seed, cache)
    for mb, corpus in corpora.items():
        shards, measured = out / f"shards-{mb}mb", out / f"prepare-{mb}mb.json"
        if args.fresh or not (shards / "manifest.json").is_file() or not measured.is_file():
            subprocess.run(["rm", "-rf", str(shards)], check=True)
            prepared = prepare_corpus(corpus, shards, out / f"prepare-{mb}mb.log", args.workers)
            measured.write_text(json.dumps(prepared, indent=1) + "\n")
            print(f"prepare {mb} MB: {json.dumps(prepared)}", flush=True)
        result["prepare"][mb] = json.loads(measured.read_text())  # a later run reuses the shards and their figures
    embedded = out / "shards-embedded"
    if not (embedded / "manifest.json").is_file():
        cmd = [sys.executable, "examples/bert/prepare.py", "--corpus", "packages", "--deepspeed_config", CONFIG]
        subprocess.run([*cmd, "--out", str(embedded), "--cache-dir", str(cache)], cwd=ROOT, check=True)
    largest = max(args.sizes)
    arms = {"embedded": ["--shards", str(embedded)], f"{largest}mb": ["--shards", str(out / f"shards-{largest}mb")]}
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm, data_args in arms.items() if repeat % 2 == 0 else reversed(arms.items()):
            record = train(ROOT, data_args, out / "train", f"{arm}-{repeat}", None, 15)
            runs[arm].append(record)
            print(f"train {arm} #{repeat}: {json.dumps(record)}", flush=True)
    result["train"] = runs
    result["access_probe"] = access_probe(out / f"shards-{largest}mb")
    print(f"access probe: {result['access_probe']}", flush=True)
    measured = out / "today.json"
    if args.today_tree is not None and (args.fresh or not measured.is_file()):
        tree = args.today_tree.resolve()
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
        cap = int(args.today_cap_gb * 2**30)
        today = train(tree, ["--text-dir", str(corpora[largest])], out / "today", "today", cap, args.today_minutes)
        measured.write_text(json.dumps({"commit": commit.stdout.strip(), "cap_gb": args.today_cap_gb, **today}) + "\n")
        print(f"today: {measured.read_text()}", flush=True)
    if args.today_tree is not None:
        result["today"] = json.loads(measured.read_text())  # an earlier run's, unless --fresh
    result["figures"] = figures(result, largest)
    return result


def figures(result: dict[str, Any], largest: int) -> dict[str, Any]:
    """The targets' figures: medians over repeats of the per-rank maxima."""
    big, small = result["train"][f"{largest}mb"], result["train"]["embedded"]

    def per_run(runs: list[dict], pick: Any) -> list[float]:
        return [pick(r) for r in runs if "resident_bytes_after_20" in r]

    rss = lambda r: max(x["rank"] for x in r["resident_bytes_after_20"])  # noqa: E731
    both = lambda r: max(x["rank"] + x["loader_workers"] for x in r["resident_bytes_after_20"])  # noqa: E731
    first = lambda r: max(r["first_step_seconds"])  # noqa: E731
    wait = lambda r: max(r["data_wait_fraction"])  # noqa: E731
    steady = lambda r: r["rank0_steps_2_to_20"]["data_wait_fraction"]  # noqa: E731
    found: dict[str, Any] = {
        "rank_resident_ratio": _ratio(per_run(big, rss), per_run(small, rss)),
        "rank_and_loader_resident_ratio": _ratio(per_run(big, both), per_run(small, both)),
        "first_step_ratio": _ratio(per_run(big, first), per_run(small, first)),
        "data_wait_fraction": {arm: per_run(result["train"][arm], wait) for arm in result["train"]},
        "data_wait_fraction_steps_2_to_20": {arm: per_run(result["train"][arm], steady) for arm in result["train"]},
        "prepare_peak_rss_gib": {mb: p["peak_rss_bytes"] / 2**30 for mb, p in result["prepare"].items()},
        "prepare_mb_per_second": {mb: p["mb_per_second"] for mb, p in result["prepare"].items()},
    }
    if "today" in result:
        today = result["today"]
        found["today_peak_rss_gib"] = today["peak_rss_bytes"] / 2**30
        found["today_reached_step"] = "first_step_seconds" in today
        found["new_over_today_peak_memory"] = (
            statistics.median(
                per_run(big, lambda r: sum(x["rank"] + x["loader_workers"] for x in r["resident_bytes_after_20"]))
            )
            / today["peak_rss_bytes"]
        )
        found["new_first_step_over_today_seconds"] = statistics.median(per_run(big, first)) / (
            max(today["first_step_seconds"]) if "first_step_seconds" in today else today["seconds"]
        )
    return found


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    gen = sub.add_parser("generate", help="write a corpus")
    gen.add_argument("--mb", type=float, required=True)
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--seed", type=int, default=0)
    go = sub.add_parser("run", help="the measurements")
    go.add_argument("--sizes", type=int, nargs="+", default=[200, 2048], help="MB of text of each generated corpus")
    go.add_argument("--out", type=Path, default=ROOT / "runs" / "bert_data")
    go.add_argument("--seed", type=int, default=0)
    go.add_argument("--workers", type=int, default=2)
    go.add_argument("--repeats", type=int, default=2, help="training runs per arm, alternating")
    go.add_argument("--fresh", action="store_true", help="prepare again even where shards exist")
    go.add_argument("--today-tree", type=Path, help="a checkout of the in-memory path, run on the largest corpus")
    go.add_argument("--today-cap-gb", type=float, default=12.0)
    go.add_argument("--today-minutes", type=float, default=30.0)
    go.add_argument("--result", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.verb == "generate":
        print(json.dumps(generate(args.out, args.mb, args.seed, ROOT / "runs" / "bert-cache" / "corpus-cache")))
        return
    args.argv = sys.argv[2:] if argv is None else argv[1:]
    result = run(args)
    args.result.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"], indent=1))


if __name__ == "__main__":
    main()
