"""K-FAC versus plain SGD on scikit-learn's bundled digits (no download).

A small CNN (two Conv2d, two Linear) is trained for the same number of steps
with the same seeded data order, once with SGD and once with SGD on K-FAC
preconditioned gradients, and the held-out accuracy of each is reported::

    python examples/digits/train.py --steps 100
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from ds_kfac import KFACPreconditioner

KFAC_SETTINGS = dict(damping=0.03, factor_update_steps=1, inv_update_steps=5, factor_decay=0.95, kl_clip=0.001)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """Digits as 1x8x8 images scaled to [0, 1]; a stratified 25% held out."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def train(use_kfac: bool, steps: int = 100, batch_size: int = 64, lr: float = 0.05, seed: int = 0) -> dict[str, float]:
    """Train from a fixed initialisation and data order; return held-out accuracy, loss and seconds."""
    x_tr, y_tr, x_te, y_te = load_data(seed)
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    kfac = KFACPreconditioner(model, optimizer=optimizer, **KFAC_SETTINGS) if use_kfac else None
    order = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    perm, pos = torch.randperm(len(x_tr), generator=order), 0
    for _ in range(steps):
        if pos + batch_size > len(perm):
            perm, pos = torch.randperm(len(x_tr), generator=order), 0
        idx = perm[pos : pos + batch_size]
        pos += batch_size
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
        if kfac is not None:
            kfac.step()
        optimizer.step()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        logits = model(x_te)
    return {
        "test_accuracy": (logits.argmax(1) == y_te).float().mean().item(),
        "test_loss": nn.functional.cross_entropy(logits, y_te).item(),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"digits, {args.steps} steps of batch {args.batch_size}, SGD(lr={args.lr}, momentum=0.9), seed {args.seed}")
    print(f"K-FAC settings: {KFAC_SETTINGS}")
    print(f"{'optimizer':<12} {'test acc':>9} {'test loss':>10} {'seconds':>8}")
    for name, use_kfac in (("SGD", False), ("SGD+K-FAC", True)):
        r = train(use_kfac, args.steps, args.batch_size, args.lr, args.seed)
        print(f"{name:<12} {r['test_accuracy']:>9.4f} {r['test_loss']:>10.4f} {r['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
