"""docs/conventions.md's one-step check on CUDA: float32 K-FAC on the GPU against the float64 CPU reference, and
factors stored in bfloat16 and float16 (``factor_dtype``), with float32 decompositions.

Skipped without CUDA. ``benchmarks/gpu/run.py --check tests --device cpu`` sets ``DS_KFAC_TEST_DEVICE=cpu`` to run
the same tests on the CPU (the bundle's dry run), where they must pass too.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_conventions import LAYERS, TOLERANCES, _problem, loss_fn, reference_step
from torch import nn

from ds_kfac import KFACPreconditioner

DEVICE = torch.device(os.environ.get("DS_KFAC_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"),
]

# Relative error ||step - reference|| / ||reference|| allowed with factors stored at lower precision (8 and 11
# mantissa bits): rounding the factors' entries moves their eigenvalues by about that fraction, which damping 0.01
# amplifies; measured on the CPU at most 3.3e-2 (bfloat16) and 6.1e-3 (float16), on linear_no_bias and linear_bias.
STORAGE_RTOL = {"bfloat16": 1e-1, "float16": 2e-2}


def device_sgd_step(layer: nn.Module, x: torch.Tensor, target: torch.Tensor, **keys) -> torch.Tensor:
    """Parameter change of one SGD(lr=1) step of float32 K-FAC on :data:`DEVICE`, as a float64 CPU matrix."""
    layer = copy.deepcopy(layer).to(DEVICE)
    before = [p.detach().clone() for p in layer.parameters()]
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    kfac = KFACPreconditioner(layer, optimizer=opt, factor_decay=0.0, kl_clip=None, **keys)
    loss_fn(layer(x.to(DEVICE)), target.to(DEVICE)).backward()
    kfac.step()
    opt.step()
    delta = [(p.detach() - b).double().cpu() for p, b in zip(layer.parameters(), before)]
    matrix = delta[0].reshape(delta[0].shape[0], -1)
    return torch.cat([matrix, delta[1].reshape(-1, 1)], 1) if len(delta) > 1 else matrix


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_float32_step_on_device_is_minus_preconditioned_gradient(case: str, method: str) -> None:
    layer, x, target, is_conv = _problem(case, seed=0)
    expected, *_ = reference_step(layer, x, target, is_conv, method, 0.01)
    delta = device_sgd_step(layer, x, target, damping=0.01, compute_method=method)
    torch.testing.assert_close(delta, -expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("storage", list(STORAGE_RTOL))
@pytest.mark.parametrize("case", list(LAYERS))
def test_low_precision_factor_storage_on_device(case: str, storage: str) -> None:
    layer, x, target, is_conv = _problem(case, seed=0)
    expected, *_ = reference_step(layer, x, target, is_conv, "eigen", 0.01)
    delta = device_sgd_step(layer, x, target, damping=0.01, factor_dtype=storage, inv_dtype="float32")
    error = (delta + expected).norm() / expected.norm()
    assert error < STORAGE_RTOL[storage], f"{storage}: relative error {error:.2e}"
