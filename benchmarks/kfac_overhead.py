"""K-FAC's cost per optimizer step, by phase, and its memory, on a BERT-shaped stack of Linear layers.

Single process, standalone preconditioner (the DeepSpeed engine runs the same
code at the accumulation boundary). Prints a Markdown table::

    python benchmarks/kfac_overhead.py                        # CPU defaults: hidden 256, 4 layers
    python benchmarks/kfac_overhead.py --hidden 1024 --layers 24 --device cuda

Also prints the greedy-LPT balance of decomposition work for the bert-large
and ResNet-50 layer lists at a few world sizes (no training involved).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_placement import bert_large_layers, resnet50_layers  # noqa: E402

from ds_kfac import KFACPreconditioner  # noqa: E402
from ds_kfac.placement import PlacementPlan  # noqa: E402


def bert_like(hidden: int, layers: int) -> nn.Module:
    """Per encoder layer: q, k, v, o (hidden -> hidden) and the feed-forward pair (hidden <-> 4 hidden)."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden) for _ in range(4)]
        blocks += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*blocks)


def time_steps(model: nn.Module, x: torch.Tensor, steps: int, kfac_keys: dict | None) -> tuple[float, dict, dict]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kfac = KFACPreconditioner(model, optimizer=opt, **kfac_keys) if kfac_keys is not None else None
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def one_step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        if kfac is not None:
            kfac.step()
        opt.step()

    for _ in range(2):  # first steps decompose and allocate
        one_step()
    if kfac is not None:
        kfac.timings.clear()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    phases = {k: v / steps for k, v in kfac.timings.items()} if kfac else {}
    return seconds, phases, kfac.memory_usage() if kfac else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device)
    print(
        f"BERT-shaped stack: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x seq {args.seq}, "
        f"{args.device}, {torch.get_num_threads()} threads, mean of {args.steps} steps\n"
    )
    print("| setting | ms/step | overhead | factors ms | decompose ms | precondition ms | K-FAC MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    settings = {
        "SGD alone": None,
        "K-FAC, factors 1, decompositions 10": {"factor_update_steps": 1, "inv_update_steps": 10},
        "K-FAC, factors 10, decompositions 100 (KAISA BERT)": {"factor_update_steps": 10, "inv_update_steps": 100},
        "K-FAC, adaptive refresh": {"factor_update_steps": 1, "inv_update_steps": "adaptive"},
    }
    base = None
    for name, keys in settings.items():
        model = bert_like(args.hidden, args.layers).to(args.device)
        seconds, phases, memory = time_steps(model, x, args.steps, keys)
        base = base or seconds
        mib = sum(memory.values()) / 2**20
        print(
            f"| {name} | {1e3 * seconds:.1f} | {seconds / base - 1:+.0%} | {1e3 * phases.get('factors', 0):.1f} | "
            f"{1e3 * phases.get('decompose', 0):.1f} | {1e3 * phases.get('precondition', 0):.1f} | {mib:.1f} |"
        )
    print("\nDecomposition balance (greedy LPT, makespan max/mean of assigned dim^3):\n")
    print("| layer list | world | comm-opt | mem-opt |")
    print("| --- | --- | --- | --- |")
    for layers in (bert_large_layers, resnet50_layers):
        shapes = layers()
        for world in (8, 32, 128):
            ratios = [PlacementPlan(shapes, world, f).makespan_ratio() for f in ("comm-opt", "mem-opt")]
            print(f"| {layers.__name__} | {world} | {ratios[0]:.3f} | {ratios[1]:.3f} |")


if __name__ == "__main__":
    main()
