"""The sampled Fisher's extra backward pass, as :meth:`~ds_kfac.KFACPreconditioner.sample_fisher`."""

from __future__ import annotations

from typing import Optional

import torch

from ..collection import FactorCollector
from ..comm import data_parallel_rank
from ..curvature import FisherLoss, sampled_loss
from ..timing import PhaseTimer


class SampledFisher:
    """:meth:`sample_fisher` of a preconditioner with these attributes (``fisher: "sampled"``)."""

    collector: FactorCollector
    timer: PhaseTimer
    accumulation_steps: int
    steps: int
    counters: dict[str, int]

    def sample_fisher(
        self,
        output: torch.Tensor,
        loss: FisherLoss = "cross_entropy",
        labels: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        generator: Optional[torch.Generator] = None,
    ) -> bool:
        """With ``fisher: "sampled"``, take this micro-batch's factors from a loss whose targets are sampled from the
        model's predictive distribution (SP-NGD's one-sample Fisher); call it after the forward pass, before the
        training loss's backward (``engine.backward(loss)``), on every micro-batch.

        On the micro-batches that gather factors it samples the targets (:func:`~ds_kfac.curvature.fisher.sampled_loss`:
        ``output`` the model's logits for ``"cross_entropy"``, its prediction for ``"mse"``; ``labels`` leave out
        the positions the training loss ignores) and back-propagates that loss to the registered layers' outputs
        only, keeping the graph: every ``.grad`` stays what the training loss makes it. Elsewhere (other steps,
        ``fisher: "empirical"``, evaluation) it does nothing. Returns whether it ran a backward pass.

        ``generator``: the sampling's random numbers; by default a generator seeded from the step, the number of
        sampled passes in it and the global rank, so a run (and one resumed from a checkpoint) samples the same
        targets."""
        if not self.collector.sampled or not self.collector.collecting:
            return False

        def scaled(detached: torch.Tensor) -> torch.Tensor:
            """The sampled loss, scaled as the training loss (divided by the accumulation, times the loss scale),
            which the hooks undo."""
            scale = self.collector.loss_scale() if self.collector.loss_scale is not None else 1.0
            sampler = generator if generator is not None else self._sampling_generator(output.device)
            return sampled_loss(detached, loss, sampler, labels, ignore_index) * (scale / self.accumulation_steps)

        with self.timer.phase("sampled_backward"):
            return self.collector.sampled_backward(output, scaled)

    def _sampling_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded from the step, the sampled passes so far in it and the global rank: the same targets
        in a run and in one resumed from a checkpoint, other targets on each rank and micro-batch."""
        rank = data_parallel_rank()  # the global rank (0 when not distributed)
        seed = (self.steps * 4099 + self.collector.sampled_passes) * 65537 + rank
        return torch.Generator(device).manual_seed(seed)

    def _count_sampled_passes(self) -> None:
        """With ``fisher: "sampled"``, count the step's sampled passes; refuse a factor step without any."""
        if not (self.collector.sampled and self.collector.collecting):
            return
        if not self.collector.sampled_passes:
            raise RuntimeError(
                f'K-FAC step {self.steps} updates factors with fisher="sampled", but no sampled backward pass reached '
                f"a registered layer: call kfac.sample_fisher(logits, loss) after each forward pass, before the "
                f"training loss's backward, in training mode (not with reentrant activation checkpointing, whose "
                f"layer outputs it cannot reach)"
            )
        self.counters["sampled_factor_steps"] += 1
        self.counters["sampled_passes"] += self.collector.sampled_passes
