"""benchmarks/refresh_cost.py at tiny shapes: each arm is the config it names, and refreshes what the schedule says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import refresh_cost  # noqa: E402

from ds_kfac import KFACConfig  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_the_arms_and_their_refreshes(tmp_path: Path) -> None:
    """One measured cycle after the warm-up cycle, 4 layers (8 sides): every arm refreshes each side once in the
    measured cycle, in full under ``eigh``, every side by a subspace step in ``unspread`` (their drifts are far below
    ``basis_max_drift`` and above 0); the arms' sections resolve to the refresh each names; the summary figures are
    those of the steps recorded."""
    out = tmp_path / "refresh_cost.json"
    refresh_cost.main(["run", "--smoke", "--data", "isotropic", "--steps", "5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"] == f"python benchmarks/refresh_cost.py run --smoke --data isotropic --steps 5 --out {out}"
    shipped = json.loads((ROOT / "configs/bert_cpu_phase2_kfac.json").read_text())["kfac"]
    resolved = {arm: KFACConfig.parse(entry["kfac"]) for arm, entry in result["arms"].items()}
    for key in ("basis_update", "refresh_spread", "basis_keep_drift"):
        assert getattr(resolved["defaults"], key) == getattr(resolved["bert_config"], key) == shipped[key]
    assert (resolved["unspread"].refresh_spread, resolved["unspread"].basis_keep_drift) == (False, 0.0)
    assert resolved["eigh"].basis_update == "eigh"
    for arm, entry in result["arms"].items():
        r = entry["data"]["isotropic"]
        counts = r["refreshes"]
        assert sum(counts.values()) == 8, arm
        assert counts == {
            "eigh": {"full": 8, "subspace": 0, "kept": 0},
            "unspread": {"full": 0, "subspace": 8, "kept": 0},
        }.get(arm, counts), arm
        assert len(r["step_ms"]) == 5
        assert r["slowest_ms"] == pytest.approx(max(r["step_ms"]), abs=1e-3)
        assert r["slowest_over_median"] == pytest.approx(r["slowest_ms"] / r["median_ms"])
        assert r["refresh_over_floor"] == pytest.approx(r["refresh_ms"] / r["floor_ms"])
        assert 0 < r["refresh_ms"] < sum(r["step_ms"]) + 1e-3
