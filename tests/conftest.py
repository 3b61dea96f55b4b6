"""Fixtures shared by the test modules."""

from __future__ import annotations

from typing import Iterator

import launch
import pytest

import ds_kfac


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The launcher's environment for one rank in this process; the process group is shut down afterwards."""
    for key, value in launch.one_rank_env().items():
        monkeypatch.setenv(key, value)
    yield
    ds_kfac.shutdown()
