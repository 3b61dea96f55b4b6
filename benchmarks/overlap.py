"""What overlapping the factor reduction with backward saves: step time with ``overlap_factor_comm`` on and off.

DDP + standalone preconditioner on a BERT-shaped stack of Linear layers,
factors every step (their reduction is the per-step traffic), decompositions
rarely. Prints a Markdown table on rank 0. Run with torchrun::

    torchrun --nproc_per_node 2 benchmarks/overlap.py                 # CPU, gloo
    torchrun --nproc_per_node 8 benchmarks/overlap.py --device cuda --hidden 1024 --layers 24

The "factors" column is the time the step spends finishing the reduction and
folding the factors in (``factor_comm`` + ``factors``): with overlap, only what
had not completed during backward.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ds_kfac
from ds_kfac import KFACPreconditioner


def bert_like(hidden: int, layers: int) -> nn.Module:
    """Per encoder layer: q, k, v, o (hidden -> hidden) and the feed-forward pair (hidden <-> 4 hidden)."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden) for _ in range(4)]
        blocks += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*blocks)


def time_steps(args: argparse.Namespace, overlap: bool) -> tuple[float, float, int]:
    """Mean seconds per step, mean seconds in the step's factor phase, and buckets reduced during backward."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = bert_like(args.hidden, args.layers).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    kfac = KFACPreconditioner(
        model,
        optimizer=opt,
        inv_update_steps=1000,
        overlap_factor_comm=overlap,
        bucket_bytes=args.bucket_mib * 2**20,
    )
    x = torch.randn(args.batch, args.seq, args.hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one_step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        kfac.step()
        opt.step()

    for _ in range(2):
        one_step()
    kfac.timings.clear()
    overlapped = kfac.distributor.factor_buckets.overlapped
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        one_step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    return (
        seconds,
        (kfac.timings["factor_comm"] + kfac.timings["factors"]) / args.steps,
        kfac.distributor.factor_buckets.overlapped - overlapped,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-mib", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    for overlap in (False, True):  # warm-up runs: allocator, gloo connections, thread pools
        time_steps(args, overlap)
    results = {overlap: time_steps(args, overlap) for overlap in (False, True)}
    if dist.get_rank() == 0:
        print(
            f"BERT-shaped stack: hidden {args.hidden}, {args.layers} layers, batch {args.batch} x seq {args.seq} "
            f"per rank, {dist.get_world_size()} ranks, {args.device}, buckets of {args.bucket_mib} MiB, "
            f"mean of {args.steps} steps after a warm-up run of each\n"
        )
        print("| overlap_factor_comm | ms/step | factors ms (at the step) | buckets reduced during backward per step |")
        print("| --- | --- | --- | --- |")
        for overlap, (seconds, factors, overlapped) in results.items():
            print(
                f"| {str(overlap).lower()} | {1e3 * seconds:.1f} | {1e3 * factors:.1f} | {overlapped / args.steps:g} |"
            )
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
