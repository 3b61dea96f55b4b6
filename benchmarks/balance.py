"""How evenly the placement plan spreads decomposition work: greedy LPT makespan over ranks.

No training: for the bert-large and ResNet-50 layer lists, the ratio of the
most loaded rank's assigned ``dim^3`` to the mean, at a few world sizes, for
``comm-opt`` and ``mem-opt``. Prints a Markdown table::

    python benchmarks/balance.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_placement import bert_large_layers, resnet50_layers  # noqa: E402

from ds_kfac.placement import PlacementPlan  # noqa: E402


def main() -> None:
    print("| layer list | world | comm-opt | mem-opt |")
    print("| --- | --- | --- | --- |")
    for layers in (bert_large_layers, resnet50_layers):
        shapes = layers()
        for world in (8, 32, 128):
            ratios = [PlacementPlan(shapes, world, f).makespan_ratio() for f in ("comm-opt", "mem-opt")]
            print(f"| {layers.__name__} | {world} | {ratios[0]:.3f} | {ratios[1]:.3f} |")


if __name__ == "__main__":
    main()
