"""Conv2d K-FAC-expand and K-FAC-reduce (``conv_factors``) against independent float64 references.

Per example ``n`` with ``R = H_out * W_out`` output positions, patches ``a_{n,r}`` and output
gradients ``g_{n,r}`` (cut out with the loops of ``reference.conv_rows``):

- expand: ``A = (1/(B R)) sum_{n,r} a a^T``, ``G = (1/(B R)) sum_{n,r} (c g)(c g)^T``
- reduce: ``A = (1/B) sum_n a_n a_n^T`` with ``a_n = (1/R) sum_r a_{n,r}`` (bias entry 1),
  ``G = (1/B) sum_n (c g_n)(c g_n)^T`` with ``g_n = sum_r g_{n,r}``

``c = B * accumulation_steps / loss_scale`` (docs/conventions.md).
"""

from __future__ import annotations

import copy

import pytest
import reference as ref
import torch
from test_conventions import kfac_sgd_step, loss_fn
from torch import nn

from ds_kfac import KFACConfig, KFACConfigError, KFACPreconditioner
from ds_kfac.layers import Conv2dAdapter

pytestmark = pytest.mark.timeout(120)

# name -> (layer factory, micro-batch input shape)
CONVS = {
    "stride_padding_bias": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (4, 2, 7, 7)),
    "dilation_no_bias": (lambda: nn.Conv2d(2, 2, 3, padding=2, dilation=2, bias=False), (3, 2, 6, 6)),
    "rectangular_bias": (lambda: nn.Conv2d(3, 2, (2, 3), stride=(2, 1), padding=(0, 1), dilation=(1, 2)), (2, 3, 6, 7)),
}


def reference_factors(
    conv: nn.Conv2d, xs: list[torch.Tensor], targets: list[torch.Tensor], conv_factors: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 A and G of one optimizer step over micro-batches ``xs``: each micro-batch's factors
    from explicit patches and the per-example gradients of its unscaled loss, averaged with equal weight."""
    conv = copy.deepcopy(conv).double()
    a_steps, g_steps = [], []
    for x, target in zip(xs, targets):
        out = conv(x.double())
        (grad,) = torch.autograd.grad(loss_fn(out, target.double()), out)
        batch = x.shape[0]
        rows = ref.conv_rows(conv, x)  # (b, y, x)-ordered patches, bias entry 1
        if conv_factors == "expand":
            a_steps.append(ref.second_moment(rows))
            g_steps.append(ref.second_moment(ref.output_grad_rows(grad, conv=True), scale=batch))
        else:
            a_steps.append(ref.second_moment(rows.reshape(batch, -1, rows.shape[1]).mean(dim=1)))
            g_steps.append(ref.second_moment(grad.double().sum(dim=(2, 3)), scale=batch))
    return torch.stack(a_steps).mean(0), torch.stack(g_steps).mean(0)


def library_factors(
    conv: nn.Module, xs: list[torch.Tensor], targets: list[torch.Tensor], **keys
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, G) per layer after one K-FAC step over micro-batches ``xs`` (each loss divided by their number)."""
    model = copy.deepcopy(conv).double()
    kfac = KFACPreconditioner(
        model,
        accumulation_steps=len(xs),
        factor_decay=0.0,
        factor_dtype="float64",
        inv_dtype="float64",
        kl_clip=None,
        **keys,
    )
    for x, target in zip(xs, targets):
        (loss_fn(model(x.double()), target.double()) / len(xs)).backward()
    kfac.step()
    return [(b.a.value, b.g.value) for b in kfac.blocks]


def _batches(case: str, micro_batches: int, seed: int) -> tuple[nn.Conv2d, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(seed)
    make, shape = CONVS[case]
    conv = make()
    xs = [torch.randn(shape) for _ in range(micro_batches)]
    return conv, xs, [torch.randn_like(conv(x)) for x in xs]


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("conv_factors", ["expand", "reduce"])
@pytest.mark.parametrize("case", list(CONVS))
def test_factors_match_reference(case: str, conv_factors: str, micro_batches: int) -> None:
    conv, xs, targets = _batches(case, micro_batches, seed=0)
    a, g = reference_factors(conv, xs, targets, conv_factors)
    [(a_lib, g_lib)] = library_factors(conv, xs, targets, conv_factors=conv_factors)
    torch.testing.assert_close(a_lib, a, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_lib, g, rtol=1e-12, atol=1e-14)


def test_expand_and_reduce_differ() -> None:
    """The factor tests above can tell the two apart (R > 1)."""
    conv, xs, targets = _batches("stride_padding_bias", 1, seed=1)
    expand, reduce = (reference_factors(conv, xs, targets, c) for c in ("expand", "reduce"))
    assert not torch.allclose(expand[0], reduce[0], rtol=1e-3)
    assert not torch.allclose(expand[1], reduce[1], rtol=1e-3)


@pytest.mark.parametrize("conv_factors", ["expand", "reduce"])
def test_one_step_is_minus_preconditioned_gradient(conv_factors: str) -> None:
    """The reduced factors are the ones P(g) uses: (A (x) G + damping I)^-1 vec(g)."""
    conv, [x], [target] = _batches("dilation_no_bias", 1, seed=2)
    a, g = reference_factors(conv, [x], [target], conv_factors)
    layer = copy.deepcopy(conv).double()
    loss_fn(layer(x.double()), target.double()).backward()
    grad = layer.weight.grad.reshape(layer.out_channels, -1)
    delta, _ = kfac_sgd_step(conv, x, target, torch.float64, damping=0.01, kl_clip=None, conv_factors=conv_factors)
    torch.testing.assert_close(delta, -ref.precondition_eigen(a, g, grad, 0.01), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_one_position_expand_equals_reduce_equals_linear(bias: bool) -> None:
    """R = 1 (the kernel covers the input): the conv is a linear layer on the flattened input, and
    expand, reduce and the linear reference (rows x_n, per-example gradients B g_n) coincide."""
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 3, (3, 4), bias=bias)
    xs = [torch.randn(5, 2, 3, 4), torch.randn(5, 2, 3, 4)]
    targets = [torch.randn(5, 3, 1, 1) for _ in xs]
    layer = copy.deepcopy(conv).double()
    a_steps, g_steps = [], []
    for x, target in zip(xs, targets):
        out = layer(x.double())
        (grad,) = torch.autograd.grad(loss_fn(out, target.double()), out)
        a_steps.append(ref.second_moment(ref.linear_rows(x.flatten(1), bias)))
        g_steps.append(ref.second_moment(ref.output_grad_rows(grad.flatten(1), conv=False), scale=x.shape[0]))
    a, g = torch.stack(a_steps).mean(0), torch.stack(g_steps).mean(0)
    for conv_factors in ("expand", "reduce"):
        [(a_lib, g_lib)] = library_factors(conv, xs, targets, conv_factors=conv_factors)
        torch.testing.assert_close(a_lib, a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g_lib, g, rtol=1e-12, atol=1e-14)


def test_reduce_is_exact_for_one_example_with_identical_patches() -> None:
    """One example whose patches are all equal (a spatially constant input, no padding): its gradient is
    W-grad = (sum_r g_r) a^T, so vec(grad) vec(grad)^T = kron(A, G) exactly for reduce, including
    the scale (no extra factor of R); expand's G averages g_r g_r^T over positions and misses it."""
    torch.manual_seed(4)
    conv = nn.Conv2d(3, 4, 2).double()
    x = torch.randn(1, 3, 1, 1, dtype=torch.float64).expand(1, 3, 5, 6)
    target = torch.randn(1, 4, 4, 5, dtype=torch.float64)
    layer = copy.deepcopy(conv)
    loss_fn(layer(x), target).backward()
    v = ref.vec(torch.cat([layer.weight.grad.reshape(4, -1), layer.bias.grad[:, None]], 1))
    fisher = torch.outer(v, v)
    [(a, g)] = library_factors(conv, [x], [target], conv_factors="reduce")
    torch.testing.assert_close(torch.kron(a, g), fisher, rtol=1e-10, atol=1e-14)
    [(a, g)] = library_factors(conv, [x], [target], conv_factors="expand")
    assert not torch.allclose(torch.kron(a, g), fisher, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: nn.Conv2d(2, 3, 4, padding="same", dilation=(1, 2)), (3, 2, 7, 8)),
        (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 7, 7)),
    ],
    ids=["same_asymmetric_padding", "unbatched_input"],
)
def test_reduce_rows_are_expand_rows_per_example(make, shape: tuple[int, ...]) -> None:
    """Reduce's rows are expand's averaged (patches) and summed (gradients) per example, also
    for the layouts the float64 reference does not cut out; half-precision inputs are reduced in float32."""
    torch.manual_seed(5)
    conv = make().double()
    x = torch.randn(shape, dtype=torch.float64)
    grad = torch.randn_like(conv(x))
    expand, reduce = Conv2dAdapter(conv), Conv2dAdapter(conv, conv_factors="reduce")
    batch = x.shape[0] if x.dim() == 4 else 1
    patches = expand.input_rows(x).reshape(batch, -1, expand.a_dim - 1)
    grads = expand.output_grad_rows(grad).reshape(batch, -1, expand.g_dim)
    torch.testing.assert_close(reduce.input_rows(x), patches.mean(1), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(reduce.output_grad_rows(grad), grads.sum(1), rtol=1e-12, atol=1e-14)
    half = x.bfloat16()
    rows = reduce.input_rows(half)
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows.double(), reduce.input_rows(half.double()), rtol=1e-6, atol=1e-7)


def test_linear_layers_ignore_conv_factors() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    x, target = torch.randn(4, 2, 6, 6), torch.randn(4, 2)
    expand = library_factors(model, [x], [target])
    reduce = library_factors(model, [x], [target], conv_factors="reduce")
    assert not torch.allclose(expand[0][0], reduce[0][0])
    torch.testing.assert_close(reduce[1], expand[1], rtol=0, atol=0)


def test_invalid_conv_factors_is_refused() -> None:
    with pytest.raises(KFACConfigError, match=r"kfac\.conv_factors: .*'expand' or 'reduce'.*'sum'"):
        KFACConfig.parse({"conv_factors": "sum"})
    with pytest.raises(ValueError, match="conv_factors must be 'expand' or 'reduce', got 'sum'"):
        Conv2dAdapter(nn.Conv2d(1, 1, 1), conv_factors="sum")
