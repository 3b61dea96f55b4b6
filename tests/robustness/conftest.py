"""Fixtures shared by the robustness modules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import launch
import pytest


@pytest.fixture(scope="session")
def two_rank_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank ``ds_worker`` launch for two modules (one launch's start-up instead of two): test_layers.py's
    frozen-parameter steps at ZeRO 0 and 2, then test_exit.py's scenario, after which the job ends with
    ``ds_kfac.shutdown()``. Returns the frozen scenarios' per-rank results, each rank's exit record and the
    /dev/shm segments the job left (see :func:`launch.run`)."""
    from test_exit import EXIT_SCENARIO
    from test_layers import FROZEN_SCENARIOS

    out = tmp_path_factory.mktemp("two_rank_job")
    left: list[Path] = []
    runs = launch.deepspeed_run(2, out, [*FROZEN_SCENARIOS, EXIT_SCENARIO], timeout=120, left_segments=left)
    exits = [json.loads((out / f"exit_rank{r}.json").read_text()) for r in range(2)]
    return {"frozen": runs[: len(FROZEN_SCENARIOS)], "exits": exits, "left": left}
