"""Metrics of BERT pretraining runs: per-step CSV, a summary table and an overlay plot.

Every run writes ``<output_dir>/<run>/metrics.csv``; the summary and the plot
cover every run found under ``<output_dir>``, so a LAMB and a K-FAC run
written to the same directory are compared in one table and one picture.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

MEMORY_STEPS = (1, 10, 20, 50, 100)
"""Steps after which each rank records its resident memory (and after the last)."""
FIELDS = ["step", "samples", "seconds", "data_seconds", "loss", "lr", "held_out_mlm_loss", "held_out_mlm_accuracy"]


class MetricsWriter:
    """Appends one row per optimizer step; on resume, rows past the resume step are dropped first."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        self.path = path
        rows = read_metrics(path) if path.exists() and resume_step > 0 else []
        kept = [r for r in rows if int(r["step"]) <= resume_step]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows({k: r.get(k, "") for k in FIELDS} for r in kept)

    def write(self, row: dict[str, object]) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, FIELDS).writerow({k: row.get(k, "") for k in FIELDS})


def read_metrics(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _last(rows: list[dict[str, str]], key: str) -> Optional[float]:
    values = [float(r[key]) for r in rows if r.get(key)]
    return values[-1] if values else None


def runs(output_dir: Path) -> dict[str, list[dict[str, str]]]:
    """Every run under ``output_dir`` with its metrics, by run name."""
    return {p.parent.name: read_metrics(p) for p in sorted(output_dir.glob("*/metrics.csv"))}


def summary_table(output_dir: Path) -> str:
    """One line per run: steps, wall time, final training loss, final held-out MLM loss and accuracy."""
    lines = [f"{'run':<24} {'steps':>6} {'seconds':>8} {'train loss':>10} {'held-out MLM loss':>17} {'MLM acc':>8}"]
    for name, rows in runs(output_dir).items():
        if not rows:
            continue

        def fmt(value: Optional[float], spec: str) -> str:
            return "-" if value is None else format(value, spec)

        lines.append(
            f"{name:<24} {rows[-1]['step']:>6} {fmt(_last(rows, 'seconds'), '8.1f')} {fmt(_last(rows, 'loss'), '10.4f')} "
            f"{fmt(_last(rows, 'held_out_mlm_loss'), '17.4f')} {fmt(_last(rows, 'held_out_mlm_accuracy'), '8.4f')}"
        )
    return "\n".join(lines)


def plot(output_dir: Path) -> Path:
    """Training loss (smoothed) and held-out MLM loss against step and wall time, all runs overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs(output_dir).items():
        steps = [int(r["step"]) for r in rows]
        seconds = [float(r["seconds"]) for r in rows]
        loss = _smooth([float(r["loss"]) for r in rows])
        held = [
            (int(r["step"]), float(r["seconds"]), float(r["held_out_mlm_loss"])) for r in rows if r["held_out_mlm_loss"]
        ]
        for ax, x in ((axes[0], steps), (axes[1], seconds)):
            (line,) = ax.plot(x, loss, label=f"{name} train MLM+NSP (smoothed)", alpha=0.8)
            if held:
                xs = [h[0] for h in held] if ax is axes[0] else [h[1] for h in held]
                ax.plot(xs, [h[2] for h in held], "o--", color=line.get_color(), label=f"{name} held-out MLM")
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"BERT pretraining runs in {output_dir}")
    fig.tight_layout()
    path = output_dir / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if not math.isnan(v) else float("nan"))
    return out


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (Linux ``/proc``; 0 elsewhere or if it is gone)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def read_bytes() -> Optional[int]:
    """The bytes this process has read through ``read`` and ``pread`` calls, from disk or the page cache (Linux
    ``/proc/self/io``'s ``rchar``; ``None`` elsewhere): what a rank read of its data before its first step."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
        return int(next(line for line in lines if line.startswith("rchar:")).removeprefix("rchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def children() -> list[int]:
    """This process's child processes (its loader workers)."""
    found = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            found += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


class RankReport:
    """What one rank reports of its run (``ranks/rank-<r>.json``): when its first step ended and what it had read
    by then, how long its steps took and waited on data, and its resident memory (with its loader workers') after
    some steps."""

    def __init__(self, rank: int) -> None:
        self.record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "steps": 0, "step_seconds": 0.0}
        self.record.update(data_wait_seconds=0.0, first_step_unix=None, resident_bytes={})

    def step(self, step: int, seconds: float, waited: float, last: bool) -> None:
        self.record["steps"] += 1
        self.record["step_seconds"] += seconds
        self.record["data_wait_seconds"] += waited
        if self.record["first_step_unix"] is None:
            self.record["first_step_unix"] = time.time()
            self.record["read_bytes_at_first_step"] = read_bytes()
        if self.record["steps"] in MEMORY_STEPS or last:
            workers = sum(resident_bytes(pid) for pid in children())
            self.record["resident_bytes"][str(step)] = {"rank": resident_bytes(), "loader_workers": workers}

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record, indent=1) + "\n")
