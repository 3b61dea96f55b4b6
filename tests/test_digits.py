"""End to end: K-FAC beats the same optimizer without it on scikit-learn's digits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

_spec = importlib.util.spec_from_file_location("digits_train", Path(__file__).parents[1] / "examples/digits/train.py")
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kfac_reaches_higher_test_accuracy_than_sgd(seed: int) -> None:
    steps = 60
    sgd = digits.train(use_kfac=False, steps=steps, seed=seed)
    kfac = digits.train(use_kfac=True, steps=steps, seed=seed)
    print(
        f"\ndigits seed {seed}, {steps} steps: SGD test acc {sgd['test_accuracy']:.4f} "
        f"(loss {sgd['test_loss']:.4f}), SGD+K-FAC test acc {kfac['test_accuracy']:.4f} (loss {kfac['test_loss']:.4f})"
    )
    assert kfac["test_accuracy"] > sgd["test_accuracy"]
