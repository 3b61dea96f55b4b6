"""The sampled Fisher's loss: targets drawn from the model's own predictive distribution (SP-NGD's ``F_1mc``).

The empirical Fisher takes ``G`` from the gradients of the training loss, whose targets are the data's. The
Fisher proper is an expectation over targets drawn from the model's predictive distribution; one sample per
output (one Monte Carlo sample) estimates it without bias. This module builds that sample's loss; the
preconditioner runs its backward (docs/conventions.md, "Sampled Fisher").
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

FisherLoss = Literal["cross_entropy", "mse"]
LOSSES = ("cross_entropy", "mse")


def _check_arguments(output: torch.Tensor, loss: str, labels: Optional[torch.Tensor]) -> None:
    """Refuse, naming the argument, what would otherwise fail inside torch or sample a meaningless ``G``: an unknown
    loss, a 0-dimensional ``output`` (the training loss passed for the logits), logits over fewer than 2 classes (one
    logit: ``softmax`` is 1, every sampled loss and so ``G`` are 0), and ``labels`` without one entry per position."""
    if loss not in LOSSES:
        raise ValueError(f"sample_fisher: loss must be one of {LOSSES}, got {loss!r}")
    if output.dim() == 0:
        raise ValueError(
            "sample_fisher: output is a 0-dimensional tensor (the training loss?); pass the model's logits "
            "(cross_entropy) or prediction (mse)"
        )
    if loss != "cross_entropy":
        return
    if output.shape[-1] < 2:
        raise ValueError(
            f"sample_fisher: cross_entropy needs logits over at least 2 classes in the last dimension, got output of "
            f"shape {tuple(output.shape)} (a single logit, as for binary cross-entropy, samples a G of 0): pass 2 "
            f"logits per position, or use mse"
        )
    if labels is not None and labels.numel() != output.numel() // output.shape[-1]:
        raise ValueError(
            f"sample_fisher: labels must hold one entry per position of the logits (shape {tuple(output.shape[:-1])}, "
            f"classes in the last dimension), got labels of shape {tuple(labels.shape)}"
        )


def sampled_loss(
    output: torch.Tensor,
    loss: FisherLoss,
    generator: torch.Generator,
    labels: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The loss of ``output`` against targets sampled from the distribution it predicts, reduced as the training
    loss is (a mean), computed in float32 or better.

    ``cross_entropy``: ``output`` holds logits over its last dimension; each position's target is drawn from
    ``softmax(logits)``, and the loss is ``F.cross_entropy``'s mean over the positions. Positions whose ``labels``
    are ``ignore_index`` (e.g. the unmasked tokens of masked language modelling) are left out, as the training
    loss leaves them out. ``mse``: the targets are ``output + e``, ``e`` standard normal (the Gaussian whose
    negative log-likelihood is ``||y - output||^2 / 2``), and the loss is ``F.mse_loss``'s mean over the elements:
    for a model whose residuals are standard normal the sampled and the empirical ``G`` agree in expectation.

    Non-finite outputs (an overflow, a bad example) are sampled from, not refused: a position whose probabilities
    are not finite draws a uniform target (``torch.multinomial`` would raise), and the loss, non-finite as the
    training loss is, gives a non-finite ``G`` that the step discards as the empirical path does (the factor keeps
    its previous value, counted in ``counters["nonfinite_factor_updates"]``), with no host sync to find it."""
    _check_arguments(output, loss, labels)
    out = output.to(torch.promote_types(output.dtype, torch.float32))
    if loss == "mse":
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device=out.device)
        return F.mse_loss(out, out.detach() + noise)
    logits = out.reshape(-1, out.shape[-1])
    with torch.no_grad():
        probabilities = logits.softmax(dim=-1)
        finite = probabilities.isfinite().all(dim=-1, keepdim=True)
        probabilities = torch.where(finite, probabilities, 1.0 / logits.shape[-1])
        targets = torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
        if labels is not None:
            targets = torch.where(labels.reshape(-1) == ignore_index, ignore_index, targets)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index)
