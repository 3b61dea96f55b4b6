"""``async_decompositions``: decompositions computed in the background and installed at a fixed later step.

The reference is a synchronous run on the same data with the learning rate at 0
(so both runs see the same gradients and factors every step): the asynchronous
run's ``P(g)`` at step ``t`` must be the synchronous decomposition of the last
decomposition step ``d`` with ``install_at(d) <= t`` applied to ``g_t``. The
distributed runs (ranks bit-identical every step, equal to one process) are in
``tests/test_placement.py`` (scenario ``mem-opt-async``).

The model, data and K-FAC's state are float64: the preconditioner applies a
decomposition to its blocks stacked, the test to one block, and in float32 the
two matmuls differ by 1-2 ulps of the largest terms on some CPUs (an AVX-512
Xeon), which the elementwise tolerance fails near zero.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_kfac import KFACConfigError, KFACPreconditioner

KEYS = {"damping": 0.01, "kl_clip": None, "factor_update_steps": 2, "inv_update_steps": 4}
KEYS |= {"factor_dtype": "float64", "inv_dtype": "float64"}
STEPS = 13


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def grads_of(net: nn.Module, kfac: KFACPreconditioner, step: int) -> list[torch.Tensor]:
    """One step at learning rate 0: the preconditioned gradients."""
    net.zero_grad()
    x, y = batch(step)
    ((net(x) - y) ** 2).mean().backward()
    kfac.step()
    return [p.grad.clone() for p in net.parameters()]


def install_step(started: int) -> int:
    """The next factor-update (every 2) or decomposition (every 4) step after ``started``."""
    return next(t for t in range(started + 1, started + 5) if t % 2 == 0 or t % 4 == 0)


def test_async_uses_the_decompositions_of_the_stated_step() -> None:
    sync_net, async_net = model(), model()
    sync = KFACPreconditioner(sync_net, lr=0.0, **KEYS)
    stale = KFACPreconditioner(async_net, lr=0.0, async_decompositions=True, **KEYS)
    states: dict[int, list] = {}  # the synchronous decompositions of each decomposition step
    for step in range(STEPS):
        grads_of(sync_net, sync, step)
        if step % 4 == 0:
            states[step] = [b.decomposition for b in sync.blocks]
        async_net.zero_grad()
        x, y = batch(step)
        ((async_net(x) - y) ** 2).mean().backward()
        g = [p.grad.clone() for p in async_net.parameters()]
        stale.step()
        got = [p.grad for p in async_net.parameters()]
        installed = [d for d in states if install_step(d) <= step]
        for i, block in enumerate(stale.blocks):
            w, b = g[2 * i], g[2 * i + 1]
            if not installed:  # nothing installed yet: the gradient passes through
                expected = [w, b]
            else:
                state = states[max(installed)][i]
                matrix = block.adapter.grad_to_matrix([w, b])
                expected = block.adapter.matrix_to_grads(block.method.precondition(state, matrix, 0.01))
            for e, actual in zip(expected, got[2 * i : 2 * i + 2]):
                torch.testing.assert_close(actual, e.reshape(actual.shape), rtol=1e-5, atol=1e-7)
    assert max(installed) == 8 and install_step(8) == 10


# The eigenvalue correction's S is re-projected at each install: saved and undone with the rest of the state.
CORRECTION = pytest.mark.parametrize("extra", [{}, {"eigenvalue_correction": True}], ids=["eigen", "corrected"])


@CORRECTION
def test_a_checkpoint_taken_while_decompositions_run_resumes_bitwise(extra: dict) -> None:
    net, again = model(), model()
    kfac = KFACPreconditioner(net, lr=0.0, async_decompositions=True, **KEYS, **extra)
    for step in range(5):  # decompositions of step 4 are pending, to be installed at step 6
        grads_of(net, kfac, step)
    saved = kfac.state_dict()
    assert saved["pending_decompositions"] == {"started": 4, "install_at": 6}
    resumed = KFACPreconditioner(again, lr=0.0, async_decompositions=True, **KEYS, **extra)
    resumed.load_state_dict(saved)
    for step in range(5, 11):
        for a, b in zip(grads_of(net, kfac, step), grads_of(again, resumed, step)):
            assert torch.equal(a, b), step


@CORRECTION
def test_an_undone_install_step_installs_again(extra: dict) -> None:
    """DeepSpeed undoes a skipped (overflowed) step with snapshot/restore: the pending work survives."""
    net, again = model(), model()
    kfac = KFACPreconditioner(net, lr=0.0, async_decompositions=True, **KEYS, **extra)
    reference = KFACPreconditioner(again, lr=0.0, async_decompositions=True, **KEYS, **extra)
    for step in range(6):
        grads_of(net, kfac, step)
        grads_of(again, reference, step)
    x, y = batch(6)
    ((net(x) - y) ** 2).mean().backward()
    snap = kfac.snapshot()
    kfac.precondition_gradients()  # installs step 4's decompositions
    assert kfac.state.scalars.pending is None
    kfac.restore(snap)
    assert kfac.state.scalars.pending is not None and kfac.state.scalars.pending.install_at == 6
    for a, b in zip(grads_of(net, kfac, 6), grads_of(again, reference, 6)):
        assert torch.equal(a, b)


def test_async_with_adaptive_refresh_is_refused() -> None:
    with pytest.raises(KFACConfigError, match="async_decompositions: true needs a fixed inv_update_steps"):
        KFACPreconditioner(model(), lr=0.1, async_decompositions=True, inv_update_steps="adaptive")


def test_work_running_at_exit_finishes_before_the_interpreter_ends(tmp_path) -> None:
    """The process may end while a decomposition runs (one started at the run's last refresh, never collected). A
    daemon thread was cut off mid-call at interpreter exit, which on a GPU (Python 3.12, cuSOLVER) aborted the process
    ("terminate called without an active exception", exit -6): the work must finish first. Here the work is a 1 s
    sleep (it releases the GIL, as LAPACK and CUDA calls do) that then writes a file."""
    import subprocess
    import sys
    import textwrap

    done = tmp_path / "done"
    script = textwrap.dedent(
        f"""
        import pathlib, time, torch
        from ds_kfac.curvature import Background
        Background(lambda: (time.sleep(1.0), pathlib.Path({str(done)!r}).write_text("ok")), torch.device("cpu"))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert done.read_text() == "ok"
