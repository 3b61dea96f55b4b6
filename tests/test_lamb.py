"""Tests of the pure-PyTorch LAMB against DeepSpeed FusedLamb's formula, and of the
optimizer factory that reads the DeepSpeed JSON ``"optimizer"`` section."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from ds_kfac import KFACConfig
from ds_kfac.optimizers import Lamb, build_optimizer, resolve_lamb
from ds_kfac.optimizers.resolve import apex_lamb_kwargs

pytestmark = pytest.mark.timeout(60)

STEPS = 6

# name -> (shape, initial-weight scale, has nonzero gradient).  Chosen to hit every
# trust-ratio branch: ``big`` clamps at max_coeff, ``tiny`` at min_coeff,
# ``zero_weight`` has ||p|| == 0 on step 1 and ``zero_grad`` has ||u|| == 0
# without weight decay (and ratio 1/weight_decay, clamped, with it).
PARAM_SPECS = {
    "weight": ((4, 3), 0.5, True),
    "bias": ((3,), 0.1, True),
    "conv": ((2, 2, 3, 3), 0.3, True),
    "big": ((3, 3), 100.0, True),
    "tiny": ((6,), 1e-4, True),
    "zero_weight": ((2, 3), 0.0, True),
    "zero_grad": ((5,), 1.0, False),
}


def make_params(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        name: (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        for name, (shape, scale, _) in PARAM_SPECS.items()
    }


def make_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float64) * (1.0 if has_grad else 0.0)
        for name, (shape, _, has_grad) in PARAM_SPECS.items()
    }


def reference_lamb(groups: list[list[str]], grads_per_step: list[dict], hp: dict) -> tuple[dict, list[list[float]]]:
    """FusedLamb's formula (csrc/lamb/fused_lamb_cuda_kernel.cu), written plainly in
    float64 and one parameter at a time.  ``groups`` is a list of lists of names;
    per-group ``weight_decay`` comes from ``hp["group_weight_decay"]`` if given.
    Returns the final weights and the trust ratios of every step."""
    weights = {name: p.clone() for name, p in make_params(torch.float64).items()}
    m = {name: torch.zeros_like(p) for name, p in weights.items()}
    v = {name: torch.zeros_like(p) for name, p in weights.items()}
    beta1, beta2 = hp["betas"]
    all_coeffs = []
    for t, grads in enumerate(grads_per_step, start=1):
        coeffs = []
        for index, names in enumerate(groups):
            decay = hp.get("group_weight_decay", [hp["weight_decay"]] * len(groups))[index]
            clip = 1.0
            if hp["max_grad_norm"] > 0:
                norm = math.sqrt(sum(float((grads[n] ** 2).sum()) for n in names))
                if (norm + 1e-6) / hp["max_grad_norm"] > 1:
                    clip = (norm + 1e-6) / hp["max_grad_norm"]
            for name in names:
                g = grads[name] / clip
                m[name] = beta1 * m[name] + (1 - beta1) * g
                v[name] = beta2 * v[name] + (1 - beta2) * g * g
                if hp["eps_inside_sqrt"]:
                    denom = torch.sqrt(v[name] + hp["eps"])
                else:
                    denom = torch.sqrt(v[name]) + hp["eps"]
                update = m[name] / denom + decay * weights[name]
                w_norm = math.sqrt(float((weights[name] ** 2).sum()))
                u_norm = math.sqrt(float((update**2).sum()))
                coeff = 1.0
                if w_norm != 0 and u_norm != 0:
                    coeff = w_norm / u_norm
                    if coeff > hp["max_coeff"]:
                        coeff = hp["max_coeff"]
                    if coeff < hp["min_coeff"]:
                        coeff = hp["min_coeff"]
                if hp["bias_correction"]:
                    step_size = hp["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                else:
                    step_size = hp["lr"]
                weights[name] = weights[name] - step_size * coeff * update
                coeffs.append(coeff)
        all_coeffs.append(coeffs)
    return weights, all_coeffs


def run_lamb(
    groups: list[list[str]], grads_per_step: list[dict], hp: dict, dtype: torch.dtype
) -> tuple[dict, list[list[float]], Lamb]:
    """Our ``Lamb`` on the same problem, parameters in ``dtype``."""
    params = {name: p.requires_grad_() for name, p in make_params(dtype).items()}
    param_groups = [{"params": [params[n] for n in names]} for names in groups]
    if "group_weight_decay" in hp:
        for group, decay in zip(param_groups, hp["group_weight_decay"]):
            group["weight_decay"] = decay
    kwargs = {k: v for k, v in hp.items() if k != "group_weight_decay"}
    opt = Lamb(param_groups, **kwargs)
    all_coeffs = []
    for grads in grads_per_step:
        for name, p in params.items():
            p.grad = grads[name].to(dtype)
        opt.step()
        all_coeffs.append(opt.get_lamb_coeffs())
    return params, all_coeffs, opt


def hyperparams(**overrides: object) -> dict:
    hp = dict(
        lr=0.01,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
    )
    hp.update(overrides)
    return hp


ONE_GROUP = [list(PARAM_SPECS)]
CASES = [
    hyperparams(weight_decay=wd, bias_correction=bc, max_grad_norm=clip, eps_inside_sqrt=inside)
    for wd, bc, clip, inside in itertools.product((0.0, 0.01), (True, False), (0.0, 0.5), (False, True))
]


def case_id(hp: dict) -> str:
    return "wd{weight_decay}-bc{bias_correction}-clip{max_grad_norm}-eps_inside{eps_inside_sqrt}".format(**hp)


def assert_matches_to_rounding(got: dict, got_coeffs: list, expected: dict, expected_coeffs: list) -> None:
    """float64 parameters and trust ratios agree with the reference to rtol 1e-12."""
    for name in PARAM_SPECS:
        torch.testing.assert_close(got[name].detach(), expected[name], rtol=1e-12, atol=1e-12, msg=name)
    for got_step, expected_step in zip(got_coeffs, expected_coeffs, strict=True):
        assert got_step == pytest.approx(expected_step, rel=1e-12)


@pytest.mark.parametrize("hp", CASES, ids=case_id)
def test_matches_fused_lamb_formula(hp: dict) -> None:
    grads = [make_grads(t) for t in range(STEPS)]
    expected, expected_coeffs = reference_lamb(ONE_GROUP, grads, hp)

    # float64 parameters (float64 state): agreement to rounding, rtol 1e-12.
    got, got_coeffs, _ = run_lamb(ONE_GROUP, grads, hp, torch.float64)
    assert_matches_to_rounding(got, got_coeffs, expected, expected_coeffs)

    # float32 parameters against the float64 reference: rtol 1e-5.
    got32, _, _ = run_lamb(ONE_GROUP, grads, hp, torch.float32)
    for name in PARAM_SPECS:
        torch.testing.assert_close(got32[name].detach().double(), expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_trust_ratio_edge_cases_are_hit() -> None:
    """The fixture really exercises the clamp and zero-norm branches."""
    grads = [make_grads(t) for t in range(STEPS)]
    names = list(PARAM_SPECS)
    for decay, zero_grad_coeff in ((0.0, 1.0), (0.01, 10.0)):
        _, coeffs, _ = run_lamb(ONE_GROUP, grads, hyperparams(weight_decay=decay), torch.float64)
        first = dict(zip(names, coeffs[0]))
        assert first["big"] == 10.0
        assert first["tiny"] == pytest.approx(0.01)
        assert first["zero_weight"] == 1.0
        assert all(dict(zip(names, c))["zero_grad"] == pytest.approx(zero_grad_coeff) for c in coeffs)


def test_clipping_is_per_param_group() -> None:
    groups = [["weight", "bias", "big", "zero_grad"], ["conv", "tiny", "zero_weight"]]
    hp = hyperparams(max_grad_norm=0.5, group_weight_decay=[0.01, 0.0])
    grads = [make_grads(t) for t in range(STEPS)]
    expected, expected_coeffs = reference_lamb(groups, grads, hp)
    got, got_coeffs, _ = run_lamb(groups, grads, hp, torch.float64)
    assert_matches_to_rounding(got, got_coeffs, expected, expected_coeffs)


def test_params_without_grad_are_skipped_and_closure_is_called() -> None:
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(2))
    opt = Lamb([a, b])
    loss = opt.step(lambda: (a * 2.0).sum().backward() or 7.0)
    assert loss == 7.0
    assert b not in opt.state and torch.equal(b.detach(), torch.ones(2))
    assert len(opt.get_lamb_coeffs()) == 1 and not torch.equal(a.detach(), torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_params_keep_fp32_state(dtype: torch.dtype) -> None:
    hp = hyperparams(weight_decay=0.01)
    # Gradients representable in the half dtype, so both runs see the same ones.
    grads = [{n: g.to(dtype).double() for n, g in make_grads(t).items()} for t in range(STEPS)]
    ref, _, _ = run_lamb(ONE_GROUP, grads, hp, torch.float32)
    got, _, opt = run_lamb(ONE_GROUP, grads, hp, dtype)
    start = make_params(torch.float32)
    for name, p in got.items():
        assert p.dtype == dtype
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
        # Half-precision rounding of the weights each step: 1e-2 relative.
        torch.testing.assert_close(p.detach().float(), ref[name].detach(), rtol=1e-2, atol=1e-3, msg=name)
        if name in ("weight", "conv"):
            assert not torch.equal(p.detach().float(), start[name].to(dtype).float()), name


def test_state_dict_roundtrip_keeps_fp32_state() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    opt = Lamb([p], lr=0.01)
    p.grad = torch.randn(4, 4).bfloat16()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint would be: no shared tensors
    clone = torch.nn.Parameter(p.detach().clone())
    restored = Lamb([clone], lr=0.01)
    restored.load_state_dict(saved)
    assert restored.state[clone]["exp_avg"].dtype == torch.float32
    assert restored.state[clone]["step"] == 1
    torch.testing.assert_close(restored.state[clone]["exp_avg_sq"], opt.state[p]["exp_avg_sq"], rtol=0, atol=0)
    grad = torch.randn(4, 4).bfloat16()
    p.grad, clone.grad = grad, grad.clone()
    opt.step()
    restored.step()
    assert torch.equal(p.detach(), clone.detach())


def test_lamb_defaults_match_fused_lamb() -> None:
    opt = Lamb([torch.nn.Parameter(torch.zeros(1))])
    assert opt.defaults == dict(
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        eps_inside_sqrt=False,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_coeff=10.0,
        min_coeff=0.01,
    )


USER_LAMB_CONFIG = {
    "type": "Lamb",
    "params": {
        "lr": 1e-3,
        "weight_decay": 0.01,
        "bias_correction": True,
        "betas": [0.9, 0.999],
        "eps": 1e-6,
        "max_coeff": 10.0,
        "min_coeff": 0.01,
    },
}


@pytest.mark.parametrize("type_name", ["Lamb", "lamb", "LAMB"])
def test_build_optimizer_lamb_from_user_config(type_name: str) -> None:
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(type_name, model.parameters(), USER_LAMB_CONFIG["params"])
    assert type(opt) is Lamb
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-6 and group["weight_decay"] == 0.01
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert len(opt.get_lamb_coeffs()) == 2


def test_build_optimizer_sgd() -> None:
    model = torch.nn.Linear(4, 3)
    params = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "dampening": 0.0}
    opt = build_optimizer("sgd", model.parameters(), params)
    assert type(opt) is torch.optim.SGD
    assert opt.param_groups[0]["nesterov"] is True and opt.param_groups[0]["momentum"] == 0.9


def test_build_optimizer_unknown_type() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer type 'Adagrad'.*Lamb.*SGD.*Adam.*AdamW"):
        build_optimizer("Adagrad", [torch.nn.Parameter(torch.zeros(1))], {})


@pytest.mark.parametrize(
    "type_name, params, key",
    [("Lamb", {"lr": 1e-3, "momentum": 0.9}, "momentum"), ("SGD", {"lr": 0.1, "betas": [0.9, 0.99]}, "betas")],
)
def test_build_optimizer_unknown_param(type_name: str, params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown parameter\(s\) \['{key}'\].*allowed"):
        build_optimizer(type_name, [torch.nn.Parameter(torch.zeros(1))], params)


def test_amsgrad_is_refused() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer("Lamb", [torch.nn.Parameter(torch.zeros(1))], {"amsgrad": True})
    with pytest.raises(ValueError, match="amsgrad"):
        Lamb([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)


def test_resolve_lamb_on_cpu_is_pure_pytorch() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert type(resolve_lamb(params, lr=0.1)) is Lamb
    assert type(resolve_lamb((p for p in params), backend="torch")) is Lamb
    with pytest.raises(ValueError, match="backend 'apex' unavailable"):
        resolve_lamb(params, backend="apex")
    with pytest.raises(ValueError, match="backend 'deepspeed' unavailable"):
        resolve_lamb(params, backend="deepspeed")
    with pytest.raises(ValueError, match="unknown LAMB backend 'cuda'"):
        resolve_lamb(params, backend="cuda")


def test_json_lamb_is_chosen_by_the_device_the_engine_moves_the_model_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """ds_kfac.initialize builds a JSON optimizer before DeepSpeed moves the model to its accelerator, so the
    parameters are still on the CPU: the fused backend is chosen by the engine's device (on a GPU, JSON "Lamb"
    with K-FAC on had resolved to the pure-PyTorch Lamb). A stand-in FusedLamb records that it was built."""
    from ds_kfac.integration import optimizer_setup as setup
    from ds_kfac.optimizers import resolve

    built = []
    fake = ("deepspeed", resolve._deepspeed_unsupported, lambda params, kwargs: built.append(kwargs) or "fused")
    monkeypatch.setattr(resolve, "_FUSED_BACKENDS", (fake,))
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert type(resolve_lamb(params, lr=0.1)) is Lamb and not built  # the CPU, where the parameters are
    assert resolve_lamb(params, lr=0.1, device=torch.device("cuda", 0)) == "fused" and built == [{"lr": 0.1}]
    assert type(resolve_lamb(params, lr=0.1, device=torch.device("cpu"))) is Lamb

    def broken(params, kwargs):
        raise RuntimeError("no nvcc")

    monkeypatch.setattr(resolve, "_FUSED_BACKENDS", (("deepspeed", resolve._deepspeed_unsupported, broken),))
    with pytest.warns(RuntimeWarning, match="pure-PyTorch Lamb.*deepspeed LAMB failed to construct.*no nvcc"):
        assert type(resolve_lamb(params, lr=0.1, device=torch.device("cuda", 0))) is Lamb
    monkeypatch.setattr(resolve, "_FUSED_BACKENDS", (fake,))

    model = torch.nn.Linear(2, 2)
    assert setup.engine_device(model) == torch.device("cpu")  # this machine's accelerator
    model.weight.ds_id = 0  # built under zero.Init: ZeRO-3 places it
    assert setup.engine_device(model) is None
    monkeypatch.setattr(setup, "engine_device", lambda model: torch.device("cuda", 0))
    config = {"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}
    assert setup.optimizer_from_json(config, torch.nn.Linear(2, 2), None, KFACConfig.parse({})) == "fused"


def test_apex_argument_mapping() -> None:
    mapped = apex_lamb_kwargs({"lr": 0.1, "betas": (0.8, 0.9), "max_coeff": 5.0})
    assert mapped == dict(
        lr=0.1,
        betas=(0.8, 0.9),
        eps=1e-8,
        weight_decay=0.0,
        max_grad_norm=math.inf,
        adam_w_mode=True,
        grad_averaging=True,
        use_nvlamb=True,
    )
    assert apex_lamb_kwargs({"max_grad_norm": 1.5})["max_grad_norm"] == 1.5
