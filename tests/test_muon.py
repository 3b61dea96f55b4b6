"""JSON ``Muon`` with ``eigenbasis_moments``: DeepSpeed's Muon for the matrices K-FAC leaves, the key's Adam for
K-FAC's layers (ds_kfac/optimizers/muon.py)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.muon.original_muon import muon_update
from torch import nn

import ds_kfac
from ds_kfac import KFACConfigError
from ds_kfac.optimizers import GROUP_KEY
from ds_kfac.optimizers.muon import MUON_KEY, build_muon

MUON = {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.9, 0.99], "eps": 1e-8}


class Tiny(nn.Module):
    """An embedding (Adam by DeepSpeed's rule), two matrices with biases and a LayerNorm (biases and norm: Adam)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.body = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(self.embed(ids)))))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """The usual recipe's groups: no weight decay on biases and norms."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not (n.endswith("bias") or "norm" in n)]},
        {"params": [p for n, p in named if n.endswith("bias") or "norm" in n], "weight_decay": 0.0},
    ]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (8,), generator=g), torch.randn(8, 4, generator=g)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    ids, target = _batch(step)
    return (model(ids) - target).pow(2).mean()


def test_without_kfac_layers_it_is_deepspeeds_json_muon(engines: list) -> None:
    """Three steps bitwise equal to the optimizer DeepSpeed's engine builds from the same JSON (its torch AdamW
    half), with per-group weight decay kept: the routing of parameters and every setting are DeepSpeed's. Both run
    DeepSpeed's ``muon_update`` eagerly (ds_kfac's Muon never compiles it: seconds at the first step, no speed on
    the few matrices K-FAC leaves; compiled, its results differ from eager ones in the last bits)."""
    torch.manual_seed(0)
    ours, theirs = Tiny(), Tiny()
    theirs.load_state_dict(ours.state_dict())
    config = {
        "train_batch_size": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default clips (1.0)
        "optimizer": {"type": "Muon", "params": {**MUON, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=theirs, model_parameters=_groups(theirs), config=config)
    engines.append(engine)
    names = {id(p): n for n, p in ours.named_parameters()}
    optimizer = build_muon(_groups(ours), names, MUON)
    assert sorted(len(g["params"]) for g in optimizer.param_groups if g[MUON_KEY]) == [2]  # body, head weights
    for step in range(3):
        engine.backward(_loss(engine.module, step))
        with torch.compiler.set_stance("force_eager"):
            engine.step()
        optimizer.zero_grad()
        _loss(ours, step).backward()
        optimizer.step()
    for (name, got), want in zip(ours.named_parameters(), engine.module.parameters()):
        assert torch.equal(got, want), name
    before = copy.deepcopy(ours.state_dict())
    optimizer.zero_grad()
    _loss(ours, 3).backward()
    optimizer.step()
    assert not torch.equal(before["body.weight"], ours.body.weight)  # can fail: the steps do move the weights


KFAC = {"eigenbasis_moments": True, "skip_layers": ["^head"], "factor_update_steps": 1, "inv_update_steps": 1}


def _kfac_engine(engines: list, optimizer: dict, model: nn.Module, kfac: dict = KFAC, **extra: Any):
    config = {"train_batch_size": 1, "gradient_clipping": 0.0, "optimizer": optimizer, "kfac": kfac, **extra}
    engine, opt, *_ = ds_kfac.initialize(model=model, model_parameters=_groups(model), config=config)
    engines.append(engine)
    return engine, opt


def test_kfac_layers_take_the_keys_adam_and_the_others_muon(engines: list) -> None:
    """K-FAC registers ``body``; ``head`` is skipped. After one step ``body`` is where JSON AdamW with the key
    (at ``adam_lr``) puts it, bitwise; ``head.weight`` took DeepSpeed's Muon update at ``muon_lr``; the
    embedding is Adam's (the AdamW run's)."""
    torch.manual_seed(0)
    models = [Tiny() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    muon, opt = _kfac_engine(engines, {"type": "Muon", "params": MUON}, models[0])
    adamw = {"lr": MUON["adam_lr"], "weight_decay": MUON["weight_decay"], "betas": MUON["betas"], "eps": MUON["eps"]}
    adam, _ = _kfac_engine(engines, {"type": "AdamW", "params": adamw}, models[1])
    flagged = {id(p) for g in opt.param_groups if g.get(GROUP_KEY) for p in g["params"]}
    assert flagged == {id(models[0].body.weight), id(models[0].body.bias)}
    assert [(g["params"], g["lr"]) for g in opt.param_groups if g[MUON_KEY]] == [([models[0].head.weight], 0.02)]

    _loss(models[2], 0).backward()  # the reference: the head's gradient at the same weights and batch
    grad = models[2].head.weight.grad
    lr, decay = MUON["muon_lr"], MUON["weight_decay"]
    update = muon_update(grad.clone(), torch.zeros_like(grad), beta=MUON["momentum"])
    want = models[2].head.weight.detach() * (1 - lr * decay) - lr * update

    for engine in (muon, adam):
        engine.backward(_loss(engine.module, 0))
        engine.step()
    assert torch.equal(models[0].body.weight, models[1].body.weight)
    assert torch.equal(models[0].embed.weight, models[1].embed.weight)
    torch.testing.assert_close(models[0].head.weight, want, rtol=0, atol=1e-7)
    assert not torch.equal(models[0].head.weight, models[1].head.weight)  # can fail: Muon is not Adam


@pytest.mark.parametrize(
    ("extra", "given"),
    [
        ({"zero_optimization": {"stage": 1}}, "ZeRO stage 1"),
        ({"zero_optimization": {"stage": 2}}, "ZeRO stage 2"),
        ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3"),
        ({"bf16": {"enabled": True}}, "ZeRO stage 0, bf16"),
        ({"fp16": {"enabled": True}}, "ZeRO stage 0, fp16"),
    ],
)
def test_flat_partitions_are_refused(engines: list, extra: dict, given: str) -> None:
    with pytest.raises(KFACConfigError, match=f"optimizer type 'Muon'.*flat partitions; this config has {given}:"):
        _kfac_engine(engines, {"type": "Muon", "params": MUON}, Tiny(), **extra)


def test_unknown_keys_are_named() -> None:
    model = Tiny()
    with pytest.raises(ValueError, match=r"optimizer type 'Muon': unknown keys \['ns_steps'\]"):
        build_muon(_groups(model), {id(p): n for n, p in model.named_parameters()}, {**MUON, "ns_steps": 3})


def test_state_dict_resumes_bitwise() -> None:
    """The momentum buffers and Adam's moments travel in ``state_dict``: two steps, a reload into a fresh
    optimizer, two more steps equal four straight steps."""
    torch.manual_seed(0)
    straight, resumed = Tiny(), Tiny()
    resumed.load_state_dict(straight.state_dict())

    def build(model: nn.Module):
        return build_muon(_groups(model), {id(p): n for n, p in model.named_parameters()}, MUON)

    def steps(model: nn.Module, optimizer: torch.optim.Optimizer, which: range) -> None:
        for step in which:
            optimizer.zero_grad()
            _loss(model, step).backward()
            optimizer.step()

    steps(straight, build(straight), range(4))
    first = build(resumed)
    steps(resumed, first, range(2))
    second = build(resumed)
    second.load_state_dict(copy.deepcopy(first.state_dict()))
    assert torch.equal(
        second.state[resumed.body.weight]["momentum_buffer"], first.state[resumed.body.weight]["momentum_buffer"]
    )
    steps(resumed, second, range(2, 4))
    for (name, got), want in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(got, want), name


def _train(engine: Any, steps: range) -> None:
    for step in steps:
        engine.backward(_loss(engine.module, step))
        engine.step()


def test_a_muon_half_with_no_matrix_is_the_keys_adam(engines: list) -> None:
    """K-FAC registers both matrices (nothing skipped), so no parameter is left for Muon: no Muon group, and three
    steps equal JSON AdamW with the key bitwise."""
    torch.manual_seed(0)
    models = [Tiny(), Tiny()]
    models[1].load_state_dict(models[0].state_dict())
    kfac = {**KFAC, "skip_layers": []}
    muon, opt = _kfac_engine(engines, {"type": "Muon", "params": MUON}, models[0], kfac)
    adamw = {"lr": MUON["adam_lr"], "weight_decay": MUON["weight_decay"], "betas": MUON["betas"], "eps": MUON["eps"]}
    adam, _ = _kfac_engine(engines, {"type": "AdamW", "params": adamw}, models[1], kfac)
    assert not any(g[MUON_KEY] for g in opt.param_groups)
    for engine in (muon, adam):
        _train(engine, range(3))
    for (name, got), want in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(got, want), name


def test_resume_across_a_refresh_with_the_muon_half_is_bitwise(engines: list, tmp_path: Path) -> None:
    """A DeepSpeed checkpoint after step 3 of 6, K-FAC refreshing every 2 steps: the Muon half's momentum buffers,
    the key's moments and K-FAC's state come back, and the resumed run equals the uninterrupted one bitwise."""
    torch.manual_seed(0)
    models = [Tiny() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    kfac = {**KFAC, "inv_update_steps": 2}
    optimizer = {"type": "Muon", "params": MUON}
    straight, _ = _kfac_engine(engines, optimizer, models[0], kfac)
    _train(straight, range(6))
    interrupted, _ = _kfac_engine(engines, optimizer, models[1], kfac)
    _train(interrupted, range(3))
    interrupted.save_checkpoint(str(tmp_path), tag="step3")
    resumed, _ = _kfac_engine(engines, optimizer, models[2], kfac)
    resumed.load_checkpoint(str(tmp_path), tag="step3")
    assert resumed.kfac.steps == 3
    _train(resumed, range(3, 6))
    for (name, got), want in zip(models[2].named_parameters(), models[0].parameters()):
        assert torch.equal(got, want), name
    assert not torch.equal(models[2].head.weight, models[1].head.weight)  # can fail: the resumed steps moved it


BASE_OPTIMIZERS = {
    "SGD": {"lr": 0.1},
    "Lamb": {"lr": 0.01},
    "Adam": {"lr": 0.01, "torch_adam": True},
    "AdamW": {"lr": 0.01, "torch_adam": True},
    "Muon": MUON,
}
"""Every JSON base optimizer K-FAC runs with, beside JSON Muon (DeepSpeed's Adams as torch's: its default, the CPU
``FusedAdam``, compiles an extension on first use, 35 s of a fresh clone's suite)."""
REFUSED = {
    ("SGD", True): "SGD keeps no second moment",
    ("Muon", False): "optimizer type 'Muon' with K-FAC needs kfac.eigenbasis_moments: true: without it DeepSpeed's "
    "Muon takes K-FAC's layers among its matrices and orthogonalises their preconditioned gradients",
}
"""What ``initialize`` refuses, by (optimizer type, with the key)."""


@pytest.mark.parametrize("moments", [False, True], ids=["plain", "moments"])
@pytest.mark.parametrize("kind", list(BASE_OPTIMIZERS))
def test_every_base_optimizer_with_and_without_the_key(engines: list, kind: str, moments: bool) -> None:
    """Refused by name: JSON Muon without the key (Newton-Schulz would orthogonalise K-FAC's preconditioned gradient,
    where docs/config.md says Muon for K-FAC's layers is not offered; before, it ran silently), SGD with it. The
    others build: with the key, K-FAC's layers (``body``) in flagged groups and no Muon group holding them; without
    it, no flagged group, and the base optimizer steps ``P(g)``."""
    kfac = {**KFAC, "eigenbasis_moments": moments}
    optimizer = {"type": kind, "params": BASE_OPTIMIZERS[kind]}
    model = Tiny()
    if (kind, moments) in REFUSED:
        with pytest.raises(KFACConfigError, match=re.escape(REFUSED[kind, moments])):
            _kfac_engine(engines, optimizer, model, kfac)
        return
    engine, opt = _kfac_engine(engines, optimizer, model, kfac)
    flagged = {id(p) for g in opt.param_groups if g.get(GROUP_KEY) for p in g["params"]}
    assert flagged == ({id(model.body.weight), id(model.body.bias)} if moments else set())
    muon = {id(p) for g in opt.param_groups if g.get(MUON_KEY) for p in g["params"]}
    assert muon == ({id(model.head.weight)} if kind == "Muon" else set())
    assert [b.name for b in engine.kfac.blocks] == ["body"]


def test_muon_without_the_key_is_plain_deepspeed_where_kfac_registers_no_layer(engines: list) -> None:
    """K-FAC enabled but every layer skipped: nothing of K-FAC's reaches Muon, so JSON Muon without the key is not
    refused (DeepSpeed's own Muon, its matrices ``body`` and ``head``)."""
    optimizer = {"type": "Muon", "params": {**MUON, "torch_adam": True}}  # its Adam half: no FusedAdam to build
    config = {"train_batch_size": 1, "gradient_clipping": 0.0, "optimizer": optimizer}
    model = Tiny()
    with pytest.warns(UserWarning, match="K-FAC registered no layer"):
        engine, opt, *_ = ds_kfac.initialize(
            model=model, model_parameters=_groups(model), config={**config, "kfac": {"skip_layers": [".*"]}}
        )
    engines.append(engine)
    muon = [p for g in opt.param_groups if g.get("use_muon") for p in g["params"]]
    assert {id(p) for p in muon} == {id(model.body.weight), id(model.head.weight)}
