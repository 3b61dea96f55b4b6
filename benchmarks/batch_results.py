"""Scoring ``batch_scaling.py``'s results: each arm's best point per batch, K-FAC's ratios, the Markdown table and
the plot, a saved result scored at another target (``rescore``), and several results joined into one (``merge``).

A variant of K-FAC (``kfac+LABEL``) is scored and tabled like any arm, but is not K-FAC's "best other arm": the
peers it is divided by are other optimizers.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from batch_ladders import KFAC, LADDERS, WORLD, arm_spec, base_arm, ordered, shape
from time_to_target import crossing, portable


def to_target(curve: list, target: float, higher_is_better: bool) -> Optional[dict[str, float]]:
    hit = crossing(curve, target, higher_is_better)
    return None if hit is None else {"steps": hit[0], "seconds": hit[1]}


def _arms(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The arms of ``runs`` in their first appearance's order."""
    return list(dict.fromkeys(r["arm"] for r in runs))


def best_points(runs: Sequence[dict[str, Any]], arms: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
    """Per arm (``arms``, default: those of ``runs``) and batch: the learning rate whose seed-0 run reached the
    target in the fewest steps, and the medians over that point's seeds (``None`` where a seed never reached it,
    or no learning rate did)."""
    arms = list(arms or _arms(runs))
    best: dict[str, dict[str, Any]] = {arm: {} for arm in arms}
    for arm in arms:
        for batch in sorted({r["batch"] for r in runs}):
            mine = [r for r in runs if r["arm"] == arm and r["batch"] == batch]
            first = [r for r in mine if r["seed"] == min(x["seed"] for x in mine)]
            reached = [r for r in first if r["to_target"] is not None]
            if not reached:
                best[arm][str(batch)] = {"lr": None, "steps": None, "seconds": None, "seeds": 0}
                continue
            lr = min(reached, key=lambda r: r["to_target"]["steps"])["lr"]
            hits = [r["to_target"] for r in mine if r["lr"] == lr]
            inf = float("inf")
            steps = statistics.median(h["steps"] if h else inf for h in hits)
            seconds = statistics.median(h["seconds"] if h else inf for h in hits)
            best[arm][str(batch)] = {
                "lr": lr,
                "steps": None if steps == inf else steps,
                "seconds": None if seconds == inf else seconds,
                "steps_per_seed": [h and h["steps"] for h in hits],
                "seconds_per_seed": [h and h["seconds"] for h in hits],
                "seeds": len(hits),
            }
    return best


def _ratio(num: dict[str, Any], den: dict[str, Any]) -> dict[str, Optional[float]]:
    return {key: None if den[key] is None or num[key] is None else num[key] / den[key] for key in ("steps", "seconds")}


def ratios(best: dict[str, dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """K-FAC / the reference arm (the first of ``best``) in steps and wall seconds to the target at each batch
    (``None`` where either never reached it)."""
    reference = next(iter(best))
    return {batch: _ratio(best[KFAC][batch], point) for batch, point in best[reference].items()}


def peer_ratios(best: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """At each batch, K-FAC / the other optimizer's arm that reached the target in the fewest steps (``"peer"``: its
    name; ``None`` where none reached it); K-FAC's variants are not its peers."""
    out = {}
    for batch in best[KFAC]:
        reached = [arm for arm in best if base_arm(arm) != KFAC and best[arm][batch]["steps"] is not None]
        peer = min(reached, key=lambda arm: best[arm][batch]["steps"], default=None)
        none = {"steps": None, "seconds": None}
        out[batch] = {"peer": peer, **(none if peer is None else _ratio(best[KFAC][batch], best[peer][batch]))}
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "never" if x is None else format(x, spec)


def table(result: dict[str, Any]) -> str:
    """The Markdown table of a result: per batch, each arm's best learning rate, steps and seconds to target, and,
    where K-FAC ran beside another arm, K-FAC against the reference arm (and, with more than two arms, against the
    best other one)."""
    best, rat = result["best"], result.get("ratios")
    arms = list(best)
    reference = arms[0]
    names = {arm: "K-FAC" if arm == KFAC else arm for arm in arms}
    with_peers = "peer_ratios" in result
    header = f"| global batch (micro x accumulation x {WORLD}) | "
    header += " | ".join(f"{names[a]} lr | {names[a]} steps | {names[a]} s" for a in arms) + " |"
    header += f" K-FAC/{reference} steps | K-FAC/{reference} wall |" if rat is not None else ""
    header += " K-FAC/best other steps | K-FAC/best other wall | best other |" if with_peers else ""
    lines = [header + " seeds |", "|" + " --- |" * header.count("|")]  # one column per "|" of the header so far
    ladder = LADDERS[result["task"]]
    for batch in sorted(best[reference], key=int):
        micro, accumulation = shape(int(batch), ladder.max_micro)
        cells = [f"{batch} ({micro} x {accumulation} x {WORLD})"]
        for arm in arms:
            p = best[arm][batch]
            cells += [_fmt(p["lr"], "g"), _fmt(p["steps"], ".0f"), _fmt(p["seconds"], ".1f")]
        if rat is not None:
            cells += [_fmt(rat[batch]["steps"], ".2f"), _fmt(rat[batch]["seconds"], ".2f")]
        if with_peers:
            q = result["peer_ratios"][batch]
            cells += [_fmt(q["steps"], ".2f"), _fmt(q["seconds"], ".2f"), q["peer"] or "none"]
        cells.append(str(min((best[arm][batch]["seeds"] for arm in arms if best[arm][batch]["seeds"]), default=0)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> Path:
    """Log-log steps to target against the global batch, one line per arm (with the perfect-scaling line through
    the reference arm's smallest batch), and wall seconds to target against the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    best = result["best"]
    for arm in best:
        points = sorted((int(b), p) for b, p in best[arm].items() if p["steps"] is not None)
        if not points:
            continue
        color = "tab:red" if arm == KFAC else None
        for ax, key in zip(axes, ("steps", "seconds")):
            ax.plot([b for b, _ in points], [p[key] for _, p in points], "o-", color=color, label=arm)
    reference = next(iter(best))
    base = sorted((int(b), p["steps"]) for b, p in best[reference].items() if p["steps"] is not None)
    if base:
        b0, s0 = base[0]
        batches = sorted(int(b) for b in best[reference])
        axes[0].plot(batches, [s0 * b0 / b for b in batches], "k--", lw=1, label="perfect scaling")
    target = result["settings"]["target"]
    for ax, ylabel in zip(axes, ("optimizer steps to target", "training seconds to target")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    size = result["settings"].get("size")
    task = result["task"] + (f" {size}" if size else "")
    fig.suptitle(f"batch scaling: {task}, steps to {result['settings']['metric']} {target}, 2 ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(best: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A result's best points and, where K-FAC ran beside another optimizer, its ratios (``peer_ratios`` beside
    two or more)."""
    out: dict[str, Any] = {"best": best}
    others = [arm for arm in best if base_arm(arm) != KFAC]
    if KFAC in best and others:
        out["ratios"] = ratios(best)
    if KFAC in best and len(others) > 1:
        out["peer_ratios"] = peer_ratios(best)
    return out


def _ladder_arms(task: str, runs: Sequence[dict[str, Any]]) -> list[str]:
    """The arms of ``runs`` in their ladder's order (the reference first, variants after their arm)."""
    return ordered(LADDERS[task], _arms(runs))


def rescore(result: dict[str, Any], target: float) -> dict[str, Any]:
    """``result`` scored at another held-out ``target`` from its stored curves: another horizon, nothing re-run
    (each arm's best learning rate is picked again at that target)."""
    higher_is_better = result["settings"]["higher_is_better"]
    runs = [r | {"to_target": to_target(r["curve"], target, higher_is_better)} for r in result["runs"]]
    kept = {key: value for key, value in result.items() if key not in ("best", "ratios", "peer_ratios")}
    settings = result["settings"] | {"target": target}
    return kept | {"settings": settings, "runs": runs} | summary(best_points(runs, _ladder_arms(result["task"], runs)))


def merge(paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """One result from the runs of several results of the same task, metric, target and size (``settings`` are
    those of the first, with the union of batches, grids, seeds and per-batch budgets; the commands are kept in a
    list)."""
    parts = [json.loads(p.read_text()) for p in paths]
    first = parts[0]
    for path, part in zip(paths, parts):
        for key in ("metric", "target", "world", "samples", "steps", "size"):
            if (part["task"], part["settings"].get(key)) != (first["task"], first["settings"].get(key)):
                raise SystemExit(f"{path}: {key} {part['settings'].get(key)!r} differs from {paths[0]}'s")
    runs = [r for part in parts for r in part["runs"]]
    seen = [(r["arm"], r["batch"], r["lr"], r["seed"]) for r in runs]
    if len(set(seen)) < len(seen):
        twice = sorted({k for k in seen if seen.count(k) > 1})
        raise SystemExit(f"runs present twice (arm, batch, lr, seed): {twice}")
    arms = _ladder_arms(first["task"], runs)
    settings = dict(first["settings"])
    settings["batches"] = sorted({r["batch"] for r in runs})
    settings["lrs"] = {arm: sorted({r["lr"] for r in runs if r["arm"] == arm}) for arm in arms}
    settings["arms"] = {arm: arm_spec(LADDERS[first["task"]], arm).config for arm in arms}
    settings["seeds"] = sorted({r["seed"] for r in runs})
    budgets: dict[str, int] = {}
    for path, part in zip(paths, parts):
        for batch, steps in (part["settings"].get("budgets") or {}).items():
            if budgets.setdefault(batch, steps) != steps:
                raise SystemExit(
                    f"{path}: budget {steps} at batch {batch} differs from an earlier part's {budgets[batch]}"
                )
    if budgets:
        settings["budgets"] = dict(sorted(budgets.items(), key=lambda item: int(item[0])))
    result = {
        "task": first["task"],
        "command": [part["command"] for part in parts],
        "settings": settings,
        "versions": first["versions"],
        "runs": runs,
        **summary(best_points(runs, arms)),
    }
    result = portable(result)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result)
    return result
