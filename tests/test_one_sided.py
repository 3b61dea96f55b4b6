"""One-sided blocks (``eigenbasis_max_dim``) and tied layers (``tied_layers: "precondition"``) under
``eigenbasis_moments``: against a float64 simulation of the documented equations with the identity for the side left
in the parameter basis, checkpoints, what is collected, and the refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
import reference as ref
import torch
from test_conventions import loss_fn
from test_eigenbasis_moments import BETAS, EPS, FLOAT64, LR, TOL, _apply, _direction, _matrix, _optimizer
from torch import nn
from workers import problem
from workers.problem import IN, OUT, TiedModel

import ds_kfac
from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner, preconditioned_parameters
from ds_kfac.curvature import KFACBlock, OneSidedBlock
from ds_kfac.optimizers import Adam, split_groups

pytestmark = pytest.mark.timeout(120)

KEYS = dict(tied_layers="precondition", eigenbasis_max_dim=8, basis_update="exact")
BATCH = 32
"""Examples a step: more than every factor's size, so no eigenvalue repeats and LAPACK's basis is the reference's."""


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(steps)]


def _run(model: nn.Module, batches: list, steps: int, **keys) -> tuple[list[nn.Module], KFACPreconditioner]:
    """Float64 AdamW steps on K-FAC's directions; the model before each step, and after."""
    model = copy.deepcopy(model).double()
    opt = _optimizer("adamw", model)
    kfac = KFACPreconditioner(model, optimizer=opt, eigenbasis_moments=True, **{**FLOAT64, **KEYS, **keys})
    states = [copy.deepcopy(model)]
    for x, target in batches[:steps]:
        opt.zero_grad()
        loss_fn(model(x.double()), target.double()).backward()
        kfac.step()
        opt.step()
        states.append(copy.deepcopy(model))
    return states, kfac


def _factors_and_grads(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, tuple]:
    """Per Linear layer of a float64 copy of ``model``: ``A`` (input rows with the bias column), ``G`` (per-example
    output gradients), and the gradient matrix of its parameters (the tied weight's: every use summed)."""
    model = copy.deepcopy(model).double()
    inputs, outputs = {}, {}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, m in layers.items():

        def keep(module, args, out, name=name):
            inputs[name] = args[0].detach()
            out.retain_grad()
            outputs[name] = out

        m.register_forward_hook(keep)
    loss_fn(model(x.double()), target.double()).backward()
    found = {}
    for name, m in layers.items():
        a = ref.second_moment(ref.linear_rows(inputs[name], True))
        g = ref.second_moment(ref.output_grad_rows(outputs[name].grad, False), scale=x.shape[0])
        grad = torch.cat([m.weight.grad, m.bias.grad[:, None]], 1)
        found[name] = a, g, grad
    return found


def test_tied_and_one_sided_layers_match_the_documented_equations() -> None:
    """Three steps, decompositions at steps 0 and 2. The first layer has both bases; the tied decoder (its weight the
    embedding's, its gradient the sum of both uses) an ``A`` basis, its 12-wide vocabulary side the identity; the head
    a ``G`` basis, its 13-wide input side the identity. Each step's parameters equal the float64 simulation to 1e-9,
    and each block holds only the factors of the sides it keeps."""
    model, batches = TiedModel(), _batches(3)
    states, kfac = _run(model, batches, 3, inv_update_steps=2)
    kinds = {b.name: (type(b), b.sides) for b in kfac.blocks}
    assert kinds == {
        "first": (KFACBlock, ("A", "G")),
        "decoder": (OneSidedBlock, ("A",)),
        "last": (OneSidedBlock, ("G",)),
    }
    _assert_simulated(states, batches, {"first": (True, True), "decoder": (True, False), "last": (False, True)})
    assert states[3].decoder.weight is states[3].embed.weight
    b1, b2 = BETAS
    # The test can fail: the decoder's moments kept in the parameter basis give another step.
    _, _, grad = _factors_and_grads(states[2], *batches[2])["decoder"]
    plain = _apply("adamw", states[2].decoder, _direction("adamw", (1 - b1) * grad, (1 - b2) * grad**2, 1), 3)
    assert not torch.allclose(plain, _matrix(states[3].decoder), rtol=1e-3)
    memory = kfac.memory_usage()
    assert memory["factors"] == 8 * (7**2 + 4**2 + 5**2 + 3**2)  # A, G of first; A of decoder; G of last


class TwoHeads(nn.Module):
    """Two ``A``-only heads (``A`` 5 wide with the bias; ``G`` 10 and 12, above ``eigenbasis_max_dim`` 8): equal
    decomposition shapes for gradients of different shapes, as BERT-small's 2048 x 513 intermediate layers and its
    8192 x 513 decoder under ``eigenbasis_max_dim: 768``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(IN, 4)
        self.narrow = nn.Linear(4, 10)
        self.wide = nn.Linear(4, 12)
        self.last = nn.Linear(22, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.last(torch.tanh(torch.cat([self.narrow(h), self.wide(h)], 1)))


def test_one_sided_blocks_of_equal_states_and_unequal_gradients() -> None:
    """Preconditioning stacks blocks by their states' shapes; two ``A``-only blocks hold equal shapes for different
    gradient shapes, and stacking them failed (found on BERT-small on a GPU). Each step equals the simulation."""
    model, batches = TwoHeads(), _batches(3)
    states, kfac = _run(model, batches, 3, inv_update_steps=2)
    assert {b.name: b.sides for b in kfac.blocks} == {
        "first": ("A", "G"), "narrow": ("A",), "wide": ("A",), "last": ("G",)
    }  # fmt: skip
    keep = {"first": (True, True), "narrow": (True, False), "wide": (True, False), "last": (False, True)}
    _assert_simulated(states, batches, keep)


def _assert_simulated(states: list[nn.Module], batches: list, keep: dict[str, tuple[bool, bool]]) -> None:
    """Each step's parameters of each top-level Linear layer named in ``keep`` (which of ``A``, ``G`` keeps a basis)
    equal the float64 simulation of AdamW in the kept bases (the identity for the other side), decompositions at
    steps 1 and 3 (``inv_update_steps=2``), to :data:`TOL`."""
    m, v, basis = {}, {}, {}
    b1, b2 = BETAS
    for t, (x, target) in enumerate(batches, start=1):
        found = _factors_and_grads(states[t - 1], x, target)
        for name, (a, g, grad) in found.items():
            if t in (1, 3):
                eye = torch.eye  # the side left in the parameter basis
                new = tuple(
                    ref.eigenbasis(f) if kept else eye(f.shape[0], dtype=f.dtype) for f, kept in zip((a, g), keep[name])
                )
                if name in basis:
                    (old_a, old_g), (new_a, new_g) = basis[name], new
                    m[name] = new_g.t() @ old_g @ m[name] @ old_a.t() @ new_a
                    v[name] = ref.rebased(v[name], basis[name], new)
                basis[name] = new
            qa, qg = basis[name]
            rotated = qg.t() @ grad @ qa
            m[name] = (1 - b1) * rotated if t == 1 else b1 * m[name] + (1 - b1) * rotated
            v[name] = (1 - b2) * rotated**2 if t == 1 else b2 * v[name] + (1 - b2) * rotated**2
            layer = getattr(states[t - 1], name)
            expected = _apply("adamw", layer, qg @ _direction("adamw", m[name], v[name], t) @ qa.t(), t)
            torch.testing.assert_close(_matrix(getattr(states[t], name)), expected, **TOL)


def test_one_sided_state_resumes_bitwise() -> None:
    """A state saved after 2 steps and loaded into a new preconditioner gives the straight run's third step exactly;
    a state of two-sided blocks is refused by a one-sided preconditioner, naming the layer."""
    model, batches = TiedModel(), _batches(3)
    straight, _ = _run(model, batches, 3, inv_update_steps=2)
    halfway, kfac = _run(model, batches, 2, inv_update_steps=2)
    resumed = copy.deepcopy(halfway[-1])
    opt = _optimizer("adamw", resumed)
    opt.load_state_dict(kfac.optimizer.state_dict())
    again = KFACPreconditioner(
        resumed, optimizer=opt, eigenbasis_moments=True, inv_update_steps=2, **{**FLOAT64, **KEYS}
    )
    again.load_state_dict(kfac.state_dict())
    opt.zero_grad()
    loss_fn(resumed(batches[2][0].double()), batches[2][1].double()).backward()
    again.step()
    opt.step()
    for a, b in zip(straight[-1].parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    two_sided = copy.deepcopy(model).double()
    other = KFACPreconditioner(
        two_sided, optimizer=_optimizer("adamw", two_sided), eigenbasis_moments=True, tied_layers="precondition"
    )
    with pytest.raises(ValueError, match="decoder"):
        other.load_state_dict(kfac.state_dict())


def test_tied_layers_skipped_by_default_and_doubly_registered_never() -> None:
    """Without the key a tied layer is skipped with a warning; with it, two (or three) registered layers sharing a
    weight are all skipped (each would precondition the same gradient)."""
    model = TiedModel().double()
    with pytest.warns(UserWarning, match="tied"):
        kfac = KFACPreconditioner(model, optimizer=_flagged(model, {}), eigenbasis_moments=True)
    assert [b.name for b in kfac.blocks] == ["first", "last"]
    shared = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    shared[2].weight = shared[0].weight
    with pytest.warns(UserWarning, match="registered layer"):
        kfac = KFACPreconditioner(shared, optimizer=_flagged(shared, KEYS), eigenbasis_moments=True, **KEYS)
    assert [b.name for b in kfac.blocks] == ["4"]
    three = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(4, 4), nn.Tanh())), nn.Linear(4, 2)).double()
    three[2].weight = three[4].weight = three[0].weight  # tied three ways: each of the three is skipped
    with pytest.warns(UserWarning, match=r"'4' \(tied: a parameter is also that of registered layer\(s\) \['0', '2'\]"):
        kfac = KFACPreconditioner(three, optimizer=_flagged(three, KEYS), eigenbasis_moments=True, **KEYS)
    assert [b.name for b in kfac.blocks] == ["6"]


def test_max_dim_below_every_side_registers_nothing_and_says_why(engines: list) -> None:
    """Issue 47, item 1: ``eigenbasis_max_dim`` below both sides of every layer skips them all; ``initialize``
    warns that K-FAC registered no layer, naming each with the value, and the model trains with the JSON AdamW
    alone (``torch.optim.AdamW``) (docs/faults.md)."""
    model = problem.make_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},  # no DeepSpeed op to build
        "kfac": {"eigenbasis_moments": True, "eigenbasis_max_dim": 1},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = ds_kfac.initialize(model=model, model_parameters=model.parameters(), config=config)
    engines.append(engine)
    assert engine.kfac.blocks == []
    (message,) = [str(w.message) for w in caught if "registered no layer" in str(w.message)]
    assert all(f"'{name}': Linear(" in message for name in ("0", "2", "4"))
    assert message.count("both sides exceed eigenbasis_max_dim=1") == 3


def test_tied_key_on_a_model_without_tied_weights_says_it_changes_nothing() -> None:
    """Issue 47, item 1: ``tied_layers: "precondition"`` where no registered layer shares a parameter (weights tied
    after K-FAC attached, or never) warns that the key changes nothing; on a tied model it does not."""
    untied = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    keys = {"tied_layers": "precondition"}
    with pytest.warns(UserWarning, match='tied_layers: "precondition" changes nothing'):
        KFACPreconditioner(untied, optimizer=_flagged(untied, keys), eigenbasis_moments=True, **keys)
    tied = TiedModel().double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KFACPreconditioner(tied, optimizer=_flagged(tied, keys), eigenbasis_moments=True, **keys)
    assert not [w for w in caught if "changes nothing" in str(w.message)]
    skip = {**keys, "skip_layers": ["^decoder"]}  # the tied layer skipped by name: the warning names it and why
    message = (
        r"changes nothing: .*the tied layers are skipped: 'decoder' \(name matches skip_layers pattern '\^decoder'\)"
    )
    with pytest.warns(UserWarning, match=message):
        kfac = KFACPreconditioner(tied, optimizer=_flagged(tied, skip), eigenbasis_moments=True, **skip)
    assert [b.name for b in kfac.blocks] == ["first", "last"]


def _flagged(model: nn.Module, keys: dict) -> torch.optim.Optimizer:
    """ds_kfac's AdamW with the parameters of the layers ``keys`` registers in flagged groups."""
    layers = preconditioned_parameters(model, KFACConfig.parse({"eigenbasis_moments": True, **keys}))
    return Adam(split_groups(model.parameters(), layers), lr=LR, betas=BETAS, eps=EPS)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"eigenbasis_max_dim": 8}, "eigenbasis_max_dim"),
        ({"tied_layers": "precondition"}, "tied_layers"),
        ({"eigenbasis_moments": True, "eigenbasis_max_dim": 0}, "eigenbasis_max_dim"),
        ({"eigenbasis_moments": True, "eigenbasis_max_dim": -3}, r"eigenbasis_max_dim.*\(got -3\)"),
        ({"eigenbasis_moments": True, "eigenbasis_max_dim": 2.5}, r"eigenbasis_max_dim.*\(got 2.5\)"),
        ({"eigenbasis_moments": True, "tied_layers": "yes"}, "tied_layers"),
    ],
)
def test_bad_settings_are_refused(keys: dict, message: str) -> None:
    with pytest.raises(KFACConfigError, match=message):
        KFACConfig.parse(keys)
