"""The small regression problem shared by the distributed workers and their single-process references."""

from __future__ import annotations

import torch
from torch import nn

import ds_kfac
from ds_kfac import KFACPreconditioner
from ds_kfac.optimizers import Adam, split_groups

IN, OUT = 6, 3


def make_model() -> nn.Module:
    """Three Linear layers whose weights and biases ZeRO splits across 2 ranks mid-layer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, OUT))


def make_uniform_model() -> nn.Module:
    """Eight equal layers: a balanced placement gives every rank the same share."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(WIDE, WIDE), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


WIDE = 10


def make_bert_tiny_shapes_model() -> nn.Module:
    """The BERT demo's 13 K-FAC layers by shape (2 encoder layers of hidden 128: query, key, value, output, the
    128 -> 512 -> 128 feed-forward; the 1,024-token decoder), chained: what a placement moves and holds depends on
    the layers' shapes alone (issue 68's scale runs)."""
    torch.manual_seed(0)
    hidden, inner, vocab = 128, 512, 1024
    shapes = [(hidden, hidden)] * 4 + [(hidden, inner), (inner, hidden)]
    layers: list[nn.Module] = []
    for fan_in, fan_out in shapes * 2 + [(hidden, vocab)]:
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


class SharedLayer(nn.Module):
    """The middle Linear runs twice per forward (weight sharing): its hooks fire twice per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.twice, self.last = nn.Linear(IN, 5), nn.Linear(5, 5), nn.Linear(5, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.last(h)


def make_batchnorm_model() -> nn.Module:
    """:func:`make_model` with a BatchNorm1d after its first layer (unit-wise BatchNorm)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, OUT))


def make_layernorm_model() -> nn.Module:
    """A wider MLP with a LayerNorm: at 8 examples a step its 16-wide factors have null spaces (issue 36's probe of
    eigenbasis moments, where LAPACK's choice of basis inside them made 2 ranks differ from one process)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, OUT)
    )


def make_narrow_layernorm_model() -> nn.Module:
    """:func:`make_layernorm_model` 8 wide: at 4 examples a rank every factor but the first ``A`` has a null space, and
    at 8 a step the last layer's 9-wide ``A`` still has one (issue 62, item 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, OUT))


class TiedModel(nn.Module):
    """A token embedding tied to a vocabulary-wide decoder, as BERT's word embeddings and MLM decoder, then a head.

    With ``tied_layers: "precondition"`` and ``eigenbasis_max_dim: 8`` the decoder (``A`` 5 wide with its bias, the
    tied weight's ``G`` side 12 wide) keeps an ``A`` basis only, the head (``A`` 13 wide, ``G`` 3) a ``G`` basis only,
    the first layer both."""

    VOCAB = 12

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, 4)
        self.first = nn.Linear(IN, 4)
        self.decoder = nn.Linear(4, self.VOCAB)
        self.decoder.weight = self.embed.weight
        self.last = nn.Linear(self.VOCAB, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x[:, 0].abs() * 7).long() % self.VOCAB
        h = torch.tanh(self.first(x) + self.embed(tokens))
        return self.last(torch.tanh(self.decoder(h)))


CONV_SIDE = 7
"""The side of :func:`make_conv_model`'s square inputs: a 3 x 3 kernel at stride 2 leaves 3 x 3 positions."""


def make_conv_model() -> nn.Module:
    """A Conv2d (2 -> 4 channels, 3 x 3, stride 2) under two Linear layers: at 8 examples a step the convolution's
    19-wide ``A`` has 72 rows, the first Linear's 37-wide ``A`` 8, so its first decomposition has a null space whose
    basis rounding picks (issue 62, item 0)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(36, 16), nn.Tanh(), nn.Linear(16, OUT)
    )


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` normalizes over its batch: a single-process reference must then run each rank's rows apart."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


MODELS = {
    "mlp": make_model,
    "uniform": make_uniform_model,
    "shared": SharedLayer,
    "batchnorm": make_batchnorm_model,
    "layernorm": make_layernorm_model,
    "narrow_layernorm": make_narrow_layernorm_model,
    "tied": TiedModel,
    "conv": make_conv_model,
    "bert_tiny_shapes": make_bert_tiny_shapes_model,
}


def param_groups(model: nn.Module) -> list[dict]:
    """Weights and biases in separate groups, as weight-decay recipes do (K-FAC must join them)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")]},
    ]


def make_optimizer(model: nn.Module, kfac: dict) -> torch.optim.Optimizer:
    """SGD on :func:`param_groups`; with ``eigenbasis_moments``, ds_kfac's AdamW with K-FAC's layers in flagged groups
    (docs/standalone.md), which then applies the directions K-FAC's moments give."""
    if not kfac.get("eigenbasis_moments"):
        return torch.optim.SGD(param_groups(model), lr=0.1)
    layers = ds_kfac.preconditioned_parameters(model, ds_kfac.KFACConfig.parse(kfac))
    return Adam(split_groups(param_groups(model), layers), lr=0.02, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)


def _example_shape(model: nn.Module | None) -> tuple[int, ...]:
    """One input example's shape: that of the first layer of a ``Sequential``, else ``IN`` features."""
    first = model[0] if isinstance(model, nn.Sequential) else None
    if isinstance(first, nn.Conv2d):
        return (first.in_channels, CONV_SIDE, CONV_SIDE)
    return (first.in_features,) if isinstance(first, nn.Linear) else (IN,)


def global_batch(step: int, size: int, model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step``: the same on every rank and world size."""
    last = model[-1].out_features if isinstance(model, nn.Sequential) else OUT
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, *_example_shape(model), generator=g), torch.randn(size, last, generator=g)


def sampling_generator(step: int, micro_batch: int, rank: int) -> torch.Generator:
    """The sampled Fisher's random numbers for a rank's micro-batch of a step: the same in a distributed run and in
    its single-process reference, which runs each rank's micro-batches one by one."""
    return torch.Generator().manual_seed(100_000 * step + 100 * micro_batch + rank)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def one_process_steps(model: nn.Module, optimizer: torch.optim.Optimizer, kfac: KFACPreconditioner, steps: int, batch: int
                      ) -> list[torch.Tensor]:  # fmt: skip
    """The distributed runs' single-process reference: ``steps`` steps, each on the whole global batch of ``batch``
    examples at once (``kfac``: a standalone preconditioner of ``model``); the parameters after."""
    for step in range(steps):
        x, y = global_batch(step, batch, model)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        kfac.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]
