"""Factor counts and hand-overs with activation checkpointing (issue 14, item 14).

``run(kind)`` trains one step of two micro-batches of a model whose two blocks
are recomputed in the backward (``kind``: ``none``, ``torch-reentrant``,
``torch-non-reentrant``, ``deepspeed``) and returns which layers handed their
statistics to the reduction during the backward and how many micro-batches
each factor counted. ``deepspeed.checkpointing`` needs DeepSpeed's
distributed backend, so that kind runs as a script (one rank, gloo)::

    python tests/workers/checkpointing.py deepspeed   # prints the JSON of run("deepspeed")
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from ds_kfac import KFACPreconditioner

Checkpoint = Callable[[nn.Module, torch.Tensor], torch.Tensor]


class Checkpointed(nn.Module):
    def __init__(self, checkpoint: Optional[Checkpoint]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.second = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint is None:
            return self.second(self.first(x))
        return self.checkpoint(self.second, self.checkpoint(self.first, x))


def _checkpoint(kind: str) -> Optional[Checkpoint]:
    if kind == "none":
        return None
    if kind == "deepspeed":
        import deepspeed

        deepspeed.checkpointing.configure(None)
        return deepspeed.checkpointing.checkpoint
    reentrant = {"torch-reentrant": True, "torch-non-reentrant": False}[kind]
    return lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=reentrant)


def run(kind: str) -> dict[str, Any]:
    model = Checkpointed(_checkpoint(kind))
    last = [False]
    kfac = KFACPreconditioner(model, lr=0.1, kl_clip=None, accumulation_steps=2, boundary=lambda: last[0])
    handed: list[str] = []
    kfac.distributor.statistics_ready = lambda block: handed.append(block.name)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g, requires_grad=True), torch.randn(16, 3, generator=g)
    for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        last[0] = i == 1
        (((model(xs) - ys) ** 2).mean() / 2).backward()
    return {
        "handed": sorted(handed),
        "layers": sorted(kfac.layer_names),
        "counts": [[b.a.pending, b.g.pending] for b in kfac.blocks],
        "A": [b.a._sum.tolist() for b in kfac.blocks],
    }


if __name__ == "__main__":
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed("gloo")
    print("RESULT " + json.dumps(run(sys.argv[1])))
    import ds_kfac

    ds_kfac.release_deepspeed_shm()
    torch.distributed.destroy_process_group()
