"""The small regression problem shared by the distributed workers and their single-process references."""

from __future__ import annotations

import torch
from torch import nn

IN, OUT = 6, 3


def make_model() -> nn.Module:
    """Three Linear layers whose weights and biases ZeRO splits across 2 ranks mid-layer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, OUT))


def param_groups(model: nn.Module) -> list[dict]:
    """Weights and biases in separate groups, as weight-decay recipes do (K-FAC must join them)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")]},
    ]


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step``: the same on every rank and world size."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()
