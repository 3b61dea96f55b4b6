"""Hostile uses of the features added since the last robustness pass (issue 22, "Also"): the sampled Fisher, unit-wise
BatchNorm, K-FAC-reduce convolutions, grafting, ``factor_micro_batches``, async decompositions, EASGD with K-FAC and
Hugging Face's ``KFACTrainer``. Each gives a clear error naming the cause, a warning, or the right result. Single
process; the DeepSpeed engines run on one gloo rank in this process.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from workers import problem

import ds_kfac
from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner

pytestmark = pytest.mark.timeout(120)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _user_warnings(model: nn.Module, **keys) -> list[str]:
    """The ``UserWarning`` messages of ``KFACPreconditioner(model, lr=0.1, **keys)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KFACPreconditioner(model, lr=0.1, **keys)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# name -> (output of the model for 8 examples, loss, labels, the error's message)
BAD_SAMPLE_FISHER = {
    "loss name": (lambda out: out, "crossentropy", None, r"loss must be one of \('cross_entropy', 'mse'\)"),
    "the loss for the logits": (
        lambda out: F.cross_entropy(out, torch.zeros(8, dtype=torch.long)),
        "mse",
        None,
        "output is a 0-dimensional tensor \\(the training loss\\?\\)",
    ),
    "one logit (binary)": (
        lambda out: out[:, :1],
        "cross_entropy",
        None,
        r"cross_entropy needs logits over at least 2 classes .* shape \(8, 1\) .* samples a G of 0",
    ),
    "labels of another batch": (
        lambda out: out,
        "cross_entropy",
        torch.zeros(4, dtype=torch.long),
        r"labels must hold one entry per position of the logits \(shape \(8,\).*got labels of shape \(4,\)",
    ),
    "one-hot labels": (
        lambda out: out,
        "cross_entropy",
        torch.zeros(8, 3),
        r"labels must hold one entry per position .* got labels of shape \(8, 3\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLE_FISHER))
def test_sample_fisher_names_a_wrong_argument(case: str) -> None:
    """A wrong loss name, the loss passed for the logits, a single logit (G would be 0: P(g) = g / damping) or labels
    without one entry per position are refused naming the argument (before: a size mismatch or IndexError from
    inside torch, or, for one logit, a silent G of 0)."""
    output, loss, labels, message = BAD_SAMPLE_FISHER[case]
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, fisher="sampled")
    with pytest.raises(ValueError, match="sample_fisher: " + message):
        kfac.sample_fisher(output(model(torch.randn(8, 5))), loss, labels=labels)


def test_sample_fisher_twice_in_a_micro_batch_counts_once_and_after_the_backward_is_an_error() -> None:
    """A second call on the same micro-batch does nothing (returns False): the factors are those of one call. A call
    after the training loss's backward is too late: the step stops naming the call."""
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    factors = []
    for calls in (1, 2):
        model = _mlp()
        kfac = KFACPreconditioner(model, kl_clip=None, fisher="sampled")
        out = model(x)
        returned = [kfac.sample_fisher(out, generator=torch.Generator().manual_seed(0)) for _ in range(calls)]
        assert returned == [True, False][:calls]
        F.cross_entropy(out, y).backward()
        kfac.step()
        factors.append([s.value for b in kfac.blocks for s in b.statistics().values()])
    assert all(torch.equal(a, b) for a, b in zip(*factors))
    model = _mlp()
    kfac = KFACPreconditioner(model, lr=0.1, fisher="sampled")
    out = model(x)
    F.cross_entropy(out, y).backward(retain_graph=True)
    kfac.sample_fisher(out)
    with pytest.raises(RuntimeError, match=r"no sampled backward pass .* before the training loss's backward"):
        kfac.step()


def test_kfac_trainer_refuses_a_wrong_fisher_loss_and_outputs_without_logits() -> None:
    """``KFACTrainer(fisher_loss="crossentropy")`` is refused when constructed (before: at the first step, from inside
    the training loop); a model whose outputs have no ``"logits"`` is named with its keys (before: ``KeyError``)."""
    from ds_kfac.hf import trainer

    with pytest.raises(ValueError, match=r"KFACTrainer: fisher_loss must be one of .* got 'crossentropy'"):
        trainer.KFACTrainer(fisher_loss="crossentropy")
    logits = torch.randn(2, 3)
    assert trainer._logits({"loss": logits.sum(), "logits": logits}) is logits
    assert trainer._logits((logits.sum(), logits)) is logits
    with pytest.raises(ValueError, match=r"returned outputs with keys \['loss', 'predictions'\]: return its logits"):
        trainer._logits({"loss": logits.sum(), "predictions": logits})
    with pytest.raises(ValueError, match="returned outputs of type Tensor"):
        trainer._logits(logits)


# name -> (model, its modules that K-FAC does not precondition, as the warning names them)
UNREGISTERED_CONVOLUTIONS = {
    "Conv1d": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.Flatten(), nn.Linear(24, 2)), "'0' (Conv1d)"),
    "Conv3d": (lambda: nn.Sequential(nn.Conv3d(3, 4, 1), nn.Flatten(), nn.Linear(32, 2)), "'0' (Conv3d)"),
    "ConvTranspose2d": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 3, 3)),
        "'1' (ConvTranspose2d)",
    ),
}


@pytest.mark.parametrize("conv_factors", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(UNREGISTERED_CONVOLUTIONS))
def test_convolutions_k_fac_does_not_precondition_are_named(case: str, conv_factors: str) -> None:
    """A Conv1d, Conv3d or transposed convolution is not preconditioned, whatever ``conv_factors`` says: one
    UserWarning names it (before: nothing said); listing it in ``skip_layers`` silences it."""
    make, named = UNREGISTERED_CONVOLUTIONS[case]
    caught = _user_warnings(make(), conv_factors=conv_factors)
    assert len(caught) == 1 and caught[0].startswith("K-FAC preconditions nn.Conv2d, not these convolutions")
    assert caught[0].endswith(named)
    assert not _user_warnings(make(), conv_factors=conv_factors, skip_layers=[named[1]])


# name -> (model, the end of the warning with batchnorm "unit-wise"; None: no warning)
BATCHNORM_MODELS = {
    "BatchNorm1d": (lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)), None),
    "without running statistics": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, track_running_stats=False)),
        None,
    ),
    "SyncBatchNorm": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4)),
        "train with the base optimizer alone (skip_layers silences this): '1' (SyncBatchNorm)",
    ),
    "BatchNorm3d": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Unflatten(1, (4, 1, 1, 1)), nn.BatchNorm3d(4)),
        "'2' (BatchNorm3d)",
    ),
    "without affine parameters": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, affine=False)),
        "the model (on a pipeline, this stage) has no such layer, so the key changes nothing",
    ),
    "no BatchNorm": (_mlp, "has no such layer, so the key changes nothing"),
}


@pytest.mark.parametrize("case", list(BATCHNORM_MODELS))
def test_batchnorm_unit_wise_names_the_batchnorms_it_does_not_precondition(case: str) -> None:
    """With ``"batchnorm": "unit-wise"``, BatchNorm layers of other types (SyncBatchNorm, BatchNorm3d) and a model
    with no BatchNorm that has affine parameters are named in one UserWarning (before: nothing said, and those
    layers trained without it). BatchNorm without running statistics is preconditioned as any."""
    make, expected = BATCHNORM_MODELS[case]
    caught = _user_warnings(make(), batchnorm="unit-wise")
    if expected is None:
        assert not caught
        model = make()
        kfac = KFACPreconditioner(model, lr=0.1, batchnorm="unit-wise", inv_update_steps=1)
        model(torch.randn(8, 5)).square().mean().backward()
        kfac.step()
        assert kfac.preconditioned == ("0", "1") and all(p.grad.isfinite().all() for p in model.parameters())
        return
    assert len(caught) == 1 and caught[0].startswith('"batchnorm": "unit-wise" preconditions nn.BatchNorm1d')
    assert caught[0].endswith(expected)
    assert not _user_warnings(make(), batchnorm="none")


def test_grafting_keeps_a_zero_gradient_layer_at_zero() -> None:
    """Grafting rescales each layer's ``P(g)`` to the norm of its ``g``: a layer whose gradient is 0 gets 0 (not
    NaN from 0 / 0), and the other layers are preconditioned as without it (no KL clip, whose sum spans layers)."""
    steps = []
    for zero in (False, True):
        model = _mlp()
        kfac = KFACPreconditioner(model, kl_clip=None, grafting="gradient", relative_damping=True, inv_update_steps=1)
        F.cross_entropy(model(torch.randn(8, 5)), torch.randint(0, 3, (8,))).backward()
        if zero:
            model[0].weight.grad.zero_()
            model[0].bias.grad.zero_()
        kfac.step()
        steps.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in steps[1][:2])
    assert all(torch.equal(a, b) for a, b in zip(steps[0][2:], steps[1][2:]))


def test_factor_micro_batches_below_1_is_refused() -> None:
    """``factor_micro_batches`` 0 or negative is refused naming the key (more than the accumulation: every
    micro-batch, ``tests/test_conventions.py``)."""
    for value in (0, -2):
        message = rf"kfac\.factor_micro_batches: must be an integer >= 1 \(got {value}\)"
        with pytest.raises(KFACConfigError, match=message):
            KFACConfig.parse({"factor_micro_batches": value})


def test_a_checkpoint_with_decompositions_in_flight_resumes_in_a_run_without_async() -> None:
    """A state saved while async decompositions run, loaded with ``async_decompositions`` off: the pending work is
    restarted from the saved factors and installed at its step, so the resumed run equals the uninterrupted one
    bitwise until its next decomposition step (which it computes at once, the async run in the background)."""
    keys = {"damping": 0.01, "kl_clip": None, "factor_update_steps": 2, "inv_update_steps": 4}
    nets = [_mlp(), _mlp()]
    kfac = KFACPreconditioner(nets[0], async_decompositions=True, **keys)

    def grads(i: int, kfac: KFACPreconditioner, step: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        nets[i].zero_grad()
        F.mse_loss(nets[i](torch.randn(8, 5, generator=g)), torch.randn(8, 3, generator=g)).backward()
        kfac.step()
        return [p.grad.clone() for p in nets[i].parameters()]

    for step in range(5):
        grads(0, kfac, step)
    saved = kfac.state_dict()
    assert saved["pending_decompositions"] == {"started": 4, "install_at": 6}
    resumed = KFACPreconditioner(nets[1], async_decompositions=False, **keys)
    resumed.load_state_dict(saved)
    for step in range(5, 8):
        assert all(torch.equal(a, b) for a, b in zip(grads(0, kfac, step), grads(1, resumed, step))), step
    assert resumed.state.scalars.pending is None


def test_easgd_with_the_sampled_fisher_trains_and_a_forgotten_call_is_named(one_rank: None) -> None:
    """EASGD with K-FAC's sampled Fisher (each rank its own factors) trains with finite weights; a loop that never
    calls ``sample_fisher`` stops at the first step naming the call."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "easgd": {"rho": 0.5},
        "kfac": {"fisher": "sampled"},
    }
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=config)
    for step in range(3):
        x, y = problem.global_batch(step, 4)
        out = engine(x)
        assert engine.kfac.sample_fisher(out, "mse")
        engine.backward(problem.loss_fn(out, y))
        engine.step()
    assert engine.kfac.steps == 3 and all(p.isfinite().all() for p in engine.module.parameters())
    engine, *_ = ds_kfac.initialize(model=problem.make_model(), config=config)
    x, y = problem.global_batch(0, 4)
    engine.backward(problem.loss_fn(engine(x), y))
    with pytest.raises(RuntimeError, match=re.escape("call kfac.sample_fisher(logits, loss) after each forward pass")):
        engine.step()


def test_kfac_trainer_with_another_gradient_accumulation_than_its_deepspeed_config_is_refused(
    one_rank: None, tmp_path
) -> None:
    """``"gradient_accumulation_steps": 4`` in the DeepSpeed config beside ``TrainingArguments(
    gradient_accumulation_steps=2)``: transformers refuses it when training starts, naming both values, before any
    step (K-FAC would otherwise unscale G by another count than the loss was divided by)."""
    from transformers import TrainingArguments
    from workers import hf_worker

    from ds_kfac.hf import KFACTrainer

    args = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed={**hf_worker.trainer_config(stage=0), "gradient_accumulation_steps": 4},
        max_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = KFACTrainer(model=hf_worker.Regression(), args=args, train_dataset=hf_worker.dataset(1, 1))
    with pytest.raises(ValueError, match="ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.state.global_step == 0
