"""Issue 68's equivalence at 4 and 8 DeepSpeed ranks: every placement at ZeRO 0 and 2, and mem-opt at ZeRO 3, after
4 steps in the full-decomposition mode, against one process on the same global batch, and every planned run's bytes,
memory and buckets against the planner on every rank. The runs are ``benchmarks/scale.py``'s (the benchmark takes
16 ranks and the demo's layer shapes; here the small ``uniform`` model keeps the launches short)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL, STEPS = "uniform", 4


@pytest.mark.parametrize("world", [4, 8])
def test_every_placement_matches_one_process_and_the_planner(world: int, tmp_path: Path) -> None:
    named = scale.scenarios(STEPS, MODEL)
    job = scale.launch(world, named, tmp_path, timeout=480)
    assert job["segments_left"] == 0
    expected = scale.one_process(world, STEPS, MODEL)
    for name, results in job["results"].items():
        assert len(results) == world
        found = scale.parameters(results, expected)
        assert found["ranks_identical"], name
        assert found["max_abs_diff"] <= 1e-5, (name, found)
        checked = scale.planner(world, named[name], results)
        if "not_planned" in checked:  # ZeRO 3
            assert named[name]["ds"]["zero_optimization"]["stage"] == 3
            continue
        assert "error" not in checked, (name, checked)
        assert checked["rows"] > 0 and not checked["differing"], (name, checked)
        assert checked["bytes_max_rel_err"] == checked["memory_max_rel_err"] == 0.0, (name, checked)
    stages = {named[n]["ds"]["zero_optimization"]["stage"] for n in named}
    placements = {named[n]["kfac"]["grad_worker_fraction"] for n in named}
    assert stages == {0, 2, 3} and placements == {"comm-opt", "hybrid-opt", "mem-opt"}
