"""The refresh's linear algebra on the device (issue 45): what a full eigendecomposition, the shipped warm-started
basis update and a matmul-only orthogonalization cost at BERT's factor widths, and how accurate each is.

Per width ``d`` a factor like K-FAC's (``F = X X^T / n + 1e-4 I``, ``X`` ``d x 2d`` Gaussian: a covariance with a
spread spectrum) and the basis of a drifted copy of it (``F`` plus a symmetric perturbation of relative norm
``DRIFT``, the median relative off-diagonal norm the BERT demo's refreshes see at its cadence), then, each timed as
the median of :data:`REPEATS` after one untimed call, the stream synchronised around it:

* ``eigh_fp32`` / ``eigh_fp64``: ``torch.linalg.eigh`` (what ``basis_update: "eigh"`` / ``"exact"`` run);
* ``matmul_fp32`` / ``matmul_tf32``: one ``d x d`` product, ``torch.set_float32_matmul_precision`` ``"highest"`` /
  ``"high"``;
* ``subspace_householder``: the shipped ``"subspace"`` update (:func:`~ds_kfac.curvature.numerics.basis_drift`
  then :func:`~ds_kfac.curvature.numerics.subspace_step`: a product and a Householder QR);
* ``subspace_cholesky_qr2``: the same step with the QR replaced by two passes of Cholesky-QR on the columns
  normalised (the same ``Q`` as Householder's in exact arithmetic: matmuls, a Cholesky and a triangular solve).

Each method's accuracy: ``orthogonality`` ``||Q^T Q - I||_max`` and ``residual``
``||F Q - Q diag(v)||_F / ||F||_F`` (for the warm updates, one step's: the drift left after it).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ds_kfac.curvature.numerics import basis_drift, subspace_step

WIDTHS = (768, 1024, 3072, 4096)
"""BERT-base's and BERT-large's factor widths (hidden, FFN; a bias column makes ``d + 1``, which costs the same)."""
TINY_WIDTHS = (32, 64)
DRIFT = 0.1
REPEATS = 3


def spd_factor(d: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A K-FAC-like factor: a sample covariance of ``2d`` Gaussian rows, plus a small ridge."""
    x = torch.randn(d, 2 * d, generator=generator, dtype=torch.float64).to(device)
    return (x @ x.mT / (2 * d) + 1e-4 * torch.eye(d, dtype=torch.float64, device=device)).float()


def drifted_basis(factor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The eigenbasis of ``factor`` plus a symmetric perturbation of relative Frobenius norm :data:`DRIFT`."""
    noise = torch.randn(factor.shape, generator=generator, dtype=torch.float64).to(factor.device)
    noise = noise + noise.mT
    moved = factor.double() + noise * (DRIFT * factor.double().norm() / noise.norm())
    return torch.linalg.eigh(moved)[1].float()


def cholesky_qr2(y: torch.Tensor) -> torch.Tensor:
    """The ``Q`` of ``y``'s QR by two passes of Cholesky-QR on its normalised columns (``R``'s diagonal positive, as
    :func:`~ds_kfac.curvature.numerics.subspace_step` signs it); raises ``LinAlgError`` where a Gram is not
    positive definite in float32."""
    q = y / y.norm(dim=-2, keepdim=True)
    for _ in range(2):
        r = torch.linalg.cholesky(q.mT @ q, upper=True)
        q = torch.linalg.solve_triangular(r, q, upper=True, left=False)
    return q


def subspace_cholesky(factor: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The shipped subspace step with :func:`cholesky_qr2` for the Householder QR."""
    y, rayleigh, _ = basis_drift(factor, basis)
    order = rayleigh.argsort(descending=True)
    return cholesky_qr2(y[:, order]), rayleigh[order].clamp(min=0.0)


def accuracy(factor: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Orthogonality and eigen-residual of ``(q, v)`` for ``factor``, in float64."""
    f, q, v = factor.double(), q.double(), v.double()
    eye = torch.eye(q.shape[-1], dtype=torch.float64, device=q.device)
    return {
        "orthogonality": float((q.mT @ q - eye).abs().max()),
        "residual": float((f @ q - q * v).norm() / f.norm()),
    }


def timed(run: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Median milliseconds of :data:`REPEATS` calls after an untimed one, and the last call's result."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = run()
    times = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        result = run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2], result


def measure(device: torch.device, widths: tuple[int, ...]) -> list[dict[str, Any]]:
    """Every method at every width (see the module docstring); a method that raises is recorded with its error."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for d in widths:
        factor = spd_factor(d, generator, device)
        basis = drifted_basis(factor, generator)
        methods: dict[str, tuple[Callable[[], Any], bool]] = {
            "eigh_fp32": (lambda: torch.linalg.eigh(factor)[::-1], True),
            "eigh_fp64": (lambda: torch.linalg.eigh(factor.double())[::-1], True),
            "subspace_householder": (lambda: subspace_step(*basis_drift(factor, basis)[:2]), True),
            "subspace_cholesky_qr2": (lambda: subspace_cholesky(factor, basis), True),
            "matmul_fp32": (lambda: factor @ basis, False),
        }
        row: dict[str, Any] = {"width": d, "drift_before": float(basis_drift(factor, basis)[2])}
        for name, (run, eigen) in methods.items():
            try:
                ms, result = timed(run, device)
            except torch.linalg.LinAlgError as error:
                row[name] = {"error": str(error).splitlines()[0]}
                continue
            row[name] = {"ms": ms, **(accuracy(factor, result[0], result[1]) if eigen else {})}
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            row["matmul_tf32"] = {"ms": timed(lambda: factor @ basis, device)[0]}
        finally:
            torch.set_float32_matmul_precision(precision)
        rows.append(row)
    return rows


def check_linalg(device: str, tiny: bool) -> dict[str, Any]:
    """:func:`measure` on ``device`` (the dry run: :data:`TINY_WIDTHS`); passes when the shipped update is finite
    and as orthogonal as float32 allows at every width."""
    rows = measure(torch.device(device), TINY_WIDTHS if tiny else WIDTHS)
    shipped = [row["subspace_householder"] for row in rows]
    return {
        "passed": all("ms" in s and s["orthogonality"] < 1e-4 for s in shipped),
        "drift": DRIFT,
        "threads": torch.get_num_threads(),
        "widths": rows,
    }
