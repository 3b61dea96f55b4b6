"""benchmarks/ladder.py: the sizes' parameter counts and the per-size ratio the report plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ladder  # noqa: E402
import peers  # noqa: E402


def _encoder_formula(layers: int, hidden: int, intermediate: int) -> int:
    """A BERT layer: Q, K, V, O with biases, the FFN's two matrices with biases, two LayerNorms."""
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden
    ffn = hidden * intermediate + intermediate + intermediate * hidden + hidden + 2 * hidden
    return layers * (attention + ffn)


@pytest.mark.parametrize(("size", "shape"), [("2x128", (2, 128, 512)), ("4x256", (4, 256, 1024))])
def test_parameter_counts_follow_the_layer_formula(size: str, shape: tuple[int, int, int]) -> None:
    counts = ladder.parameter_counts(ladder.SIZES[size], 1024)
    assert counts["encoder"] == _encoder_formula(*shape)
    assert counts["total"] > counts["encoder"] + 1024 * shape[1]  # the word embeddings at least


def _result(size: str, encoder: int, kfac_at: float, adamw_final: float = 4.0) -> dict:
    """One size's run: AdamW from 4.5 to ``adamw_final`` over 100 steps (1 s each), K-FAC reaching 4.0 at step
    ``kfac_at`` (2 s each) and ending at 3.9."""
    curves = {
        "adamw": [(50.0, 50.0, 4.5), (100.0, 100.0, adamw_final)],
        "kfac": [(kfac_at / 2, kfac_at, 4.4), (kfac_at, 2 * kfac_at, 4.0), (100.0, 200.0, 3.9)],
    }
    return {
        "size": size,
        "command": f"python benchmarks/ladder.py run {size}",
        "settings": {"seeds": [0]},
        "parameters": {"encoder": encoder, "total": encoder + 1},
        "runs": [{"arm": arm, "seed": 0, "curve": curve} for arm, curve in curves.items()],
        "summary": peers.summarize({arm: [curve] for arm, curve in curves.items()}, False),
    }


def _write(tmp_path: Path, name: str, result: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return path


def test_report_orders_sizes_and_gives_kfacs_ratio_to_adamws_final(tmp_path: Path) -> None:
    paths = [
        _write(tmp_path, f"ladder_{size}", _result(size, encoder, at))
        for size, encoder, at in (("4x256", 3_000_000, 80.0), ("2x128", 400_000, 60.0))
    ]
    result = ladder.report(paths, tmp_path / "out")
    rows = result["sizes"]
    assert [row["size"] for row in rows] == ["2x128", "4x256"]
    assert [row["steps_ratio"] for row in rows] == pytest.approx([0.6, 0.8])
    assert [row["seconds_ratio"] for row in rows] == pytest.approx([1.2, 1.6])  # K-FAC's steps cost 2 s here
    assert all(row["side_by_side"] for row in rows)
    assert json.loads((tmp_path / "out" / "ladder.json").read_text()) == result
    assert (tmp_path / "out" / "ladder.png").stat().st_size > 5_000


def test_report_takes_each_arm_at_its_grids_best(tmp_path: Path) -> None:
    """Two files of one size: AdamW is better in the second (3.95 < 4.0), K-FAC in the first (it reaches 4.0 at 60,
    not 90); the ratio is against AdamW's better final, from K-FAC's better curve, and the arms ran apart."""
    first = _write(tmp_path, "a", _result("4x256", 3_000_000, 60.0))
    second = _result("4x256", 3_000_000, 90.0, adamw_final=3.95)
    second["runs"][1]["curve"][-1] = (100.0, 200.0, 3.98)  # its K-FAC ends worse than the first's 3.9
    second["summary"] = peers.summarize({r["arm"]: [r["curve"]] for r in second["runs"]}, False)
    (row,) = ladder.report([first, _write(tmp_path, "b", second)], tmp_path / "out")["sizes"]
    assert row["files"] == {"adamw": "b.json", "kfac": "a.json"} and not row["side_by_side"]
    assert row["adamw_final"] == 3.95 and row["kfac_final"] == 3.9
    assert row["grid"] == {"adamw": {"a.json": 4.0, "b.json": 3.95}, "kfac": {"a.json": 3.9, "b.json": 3.98}}
    # K-FAC's first curve: 4.0 at step 60, then 3.9 at 100; 3.95 is crossed at 80 (linear), over AdamW's 100 steps.
    assert row["steps_ratio"] == pytest.approx(0.8)
    with pytest.raises(SystemExit, match="no file of size 2x128 has the arm 'kfac'"):
        only_adamw = _result("2x128", 400_000, 60.0)
        only_adamw["summary"].pop("kfac")
        ladder.report([_write(tmp_path, "c", only_adamw)], tmp_path / "out")
