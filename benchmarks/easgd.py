"""Synchronous EASGD against synchronous SGD on the embedded ResNet task (2 CPU ranks).

Runs ``examples/resnet/train.py`` on its small embedded data set (``--data digits``) under the ``deepspeed``
launcher with ``configs/resnet_easgd_cpu.json``, the same config without its ``"easgd"`` section (synchronous
SGD, the same batch and schedule), and the EASGD config with ``"period": 2``, alternating the three in every round
so machine noise hits all of them, and reports per configuration the held-out
accuracy (of the center for EASGD), the training milliseconds per step
(median and spread over rounds) and the bytes each rank all-reduces per step::

    python benchmarks/easgd.py --rounds 3 --out benchmarks/results/easgd.json

Bytes are the payload of one rank's all-reduce: fp32 gradients every step for
SGD, fp32 weights every ``period`` steps for EASGD (``tests/test_easgd.py``
checks the latter against ``ds_kfac.comm.STATS``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "resnet"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import launch  # noqa: E402  (free ports, timeouts, process-group kill)
from time_to_target import portable  # noqa: E402


def _parameters(depth: int = 8) -> int:
    from train import ResNet

    return sum(p.numel() for p in ResNet(depth, 1, 10).parameters() if p.requires_grad)


def _configs(tmp: Path) -> dict[str, tuple[Path, int]]:
    """name -> (config path, all-reduce period: 1 for every step)."""
    easgd = json.loads((ROOT / "configs/resnet_easgd_cpu.json").read_text())
    sgd = tmp / "resnet_sgd_digits_cpu.json"
    sgd.write_text(json.dumps({k: v for k, v in easgd.items() if k != "easgd"}))
    easgd["easgd"]["period"] = 2
    period2 = tmp / "resnet_easgd_period2_cpu.json"
    period2.write_text(json.dumps(easgd))
    return {
        "sgd": (sgd, 1),
        "easgd_period1": (ROOT / "configs/resnet_easgd_cpu.json", 1),
        "easgd_period2": (period2, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/easgd.json")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    n, load = _parameters(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        configs = _configs(Path(tmp))
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            for name, (config, _) in configs.items():
                results = Path(tmp) / f"{name}_{round_}.jsonl"
                cmd = [str(launch.BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(launch.free_port())]
                cmd += [str(ROOT / "examples/resnet/train.py"), "--deepspeed_config", str(config), "--data", "digits"]
                cmd += ["--results", str(results), "--output-dir", str(Path(tmp) / name)]
                launch.run([cmd], args.timeout)
                runs[name].append(json.loads(results.read_text().splitlines()[-1]))
                print(name, round_, runs[name][-1], flush=True)
    summary = {}
    for name, (config, period) in configs.items():
        ms = [1e3 * r["seconds"] / r["steps"] for r in runs[name]]
        summary[name] = {
            "config": config.name,
            "accuracy": [r["accuracy"] for r in runs[name]],
            "ms_per_step": {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "all": ms},
            "allreduce_bytes_per_rank_and_step": 4 * n / period,
        }
    base = summary["sgd"]["ms_per_step"]["median"]
    for entry in summary.values():
        entry["step_time_vs_sgd"] = entry["ms_per_step"]["median"] / base
    out = {
        "benchmark": "easgd",
        "command": f"python benchmarks/easgd.py --rounds {args.rounds} --out {args.out}",
        "parameters": n,
        "load_average_before": load,
        "runs": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = portable(out)
    args.out.write_text(json.dumps(out, indent=1))
    print("| run | held-out accuracy | ms per step (median; min, max) | vs SGD | bytes all-reduced per rank and step |")
    print("| --- | --- | --- | --- | --- |")
    for name, e in summary.items():
        t = e["ms_per_step"]
        print(
            f"| {name} | {e['accuracy'][0]:.4f} | {t['median']:.1f}; {t['min']:.1f}, {t['max']:.1f} | "
            f"{e['step_time_vs_sgd']:.2f} | {e['allreduce_bytes_per_rank_and_step']:,.0f} |"
        )


if __name__ == "__main__":
    main()
