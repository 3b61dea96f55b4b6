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


def _result(size: str, encoder: int, kfac_at: float) -> dict:
    """One size's result: AdamW from 5.0 to 4.0 over 100 steps, K-FAC reaching 4.0 at ``kfac_at``."""
    adamw = [(50.0, 50.0, 4.5), (100.0, 100.0, 4.0)]
    kfac = [(kfac_at / 2, kfac_at, 4.4), (kfac_at, 2 * kfac_at, 4.0), (100.0, 200.0, 3.9)]
    summary = peers.summarize({"adamw": [adamw], "kfac": [kfac]}, False)
    return {
        "size": size,
        "command": "python benchmarks/ladder.py run",
        "settings": {"seeds": [0]},
        "parameters": {"encoder": encoder, "total": encoder + 1},
        "summary": summary,
    }


def test_report_orders_sizes_and_gives_kfacs_ratio_to_adamws_final(tmp_path: Path) -> None:
    paths = []
    for size, encoder, at in (("4x256", 3_000_000, 80.0), ("2x128", 400_000, 60.0)):
        path = tmp_path / f"ladder_{size}.json"
        path.write_text(json.dumps(_result(size, encoder, at)))
        paths.append(path)
    result = ladder.report(paths, tmp_path / "out")
    rows = result["sizes"]
    assert [row["size"] for row in rows] == ["2x128", "4x256"]
    assert [row["steps_ratio"] for row in rows] == pytest.approx([0.6, 0.8])
    assert [row["seconds_ratio"] for row in rows] == pytest.approx([1.2, 1.6])  # K-FAC's steps cost 2 s here
    assert json.loads((tmp_path / "out" / "ladder.json").read_text()) == result
    assert (tmp_path / "out" / "ladder.png").stat().st_size > 5_000
