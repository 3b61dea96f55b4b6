"""SP-NGD's adaptive decomposition refresh: the interval rules, and the schedule in a real preconditioner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_kfac import KFACPreconditioner
from ds_kfac.curvature import AdaptiveRefresh

pytestmark = pytest.mark.timeout(120)
KEY = ("layer", "A")


def drive(values: list[torch.Tensor], threshold: float = 0.1) -> list[tuple[int, int]]:
    """Feed one factor value per refresh; return (refresh step, chosen interval) pairs."""
    refresh, out, step = AdaptiveRefresh([KEY], threshold), [], 0
    for value in values:
        assert refresh.due(step) == [KEY]
        assert step == 0 or refresh.due(step - 1) == []
        interval = refresh.decide(KEY, value)
        refresh.refreshed(KEY, step, interval, value)
        out.append((step, interval))
        step += interval
    return out


def test_still_factor_grows_like_fibonacci() -> None:
    still = [torch.eye(3)] * 7
    assert drive(still) == [(0, 1), (1, 1), (2, 2), (4, 3), (7, 5), (12, 8), (20, 13)]


def test_moving_factor_halves_the_interval() -> None:
    values = [torch.eye(3)] * 5 + [torch.eye(3) * 2, torch.eye(3) * 4]
    # grows 1, 1, 2, 3, 5, then moves by 100% twice: 5 -> 2 -> 1
    assert [i for _, i in drive(values)] == [1, 1, 2, 3, 5, 2, 1]


def test_moved_only_against_the_refresh_before_keeps_the_interval() -> None:
    a, b = torch.eye(3), torch.eye(3) * 1.08  # 8% apart: under the threshold step to step
    c = torch.eye(3) * 1.16  # 16% from a (two refreshes back), 7% from b (the last)
    assert [i for _, i in drive([a, a, a, b, c], threshold=0.1)] == [1, 1, 2, 3, 3]


def test_preconditioner_refreshes_on_the_adaptive_schedule() -> None:
    """Same batch every step and factor_decay 0: the factors never move, so refreshes
    happen at 0, 1, 2, 4, 7, 12 and the decomposition is replaced exactly then."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(8, 4)
    kfac = KFACPreconditioner(model, lr=0.0, inv_update_steps="adaptive", factor_decay=0.0)
    refreshed = []
    for step in range(14):
        before = kfac.blocks[0].decomposition
        model.zero_grad()
        model(x).square().mean().backward()
        kfac.step()
        if kfac.blocks[0].decomposition is not before:
            refreshed.append(step)
    assert refreshed == [0, 1, 2, 4, 7, 12]
    assert kfac.refresh.intervals() == {"0.A": 8, "0.G": 8, "2.A": 8, "2.G": 8}
