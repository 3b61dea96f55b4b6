"""What K-FAC skipped or could not do: counted, and warned about once per layer.

Each report increments a counter in the run's state (``kfac.counters``,
written to DeepSpeed's monitor as ``kfac/count/<name>`` and saved in
checkpoints) and raises a ``RuntimeWarning`` the first time a layer is
involved, so a persistent problem is visible without flooding the log.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Iterable

from .state import TrainingState

if TYPE_CHECKING:
    from .collection import FactorCollector


class Health:
    """Counters and once-per-layer warnings for one preconditioner."""

    def __init__(self, state: TrainingState, kl_clip: bool, factor_dtype: str) -> None:
        self._state = state
        self._kl_clip = kl_clip
        self._factor_dtype = factor_dtype
        self._reported: dict[str, set[str]] = {}

    def _report(self, counter: str, count: int, names: Iterable[str], message: Callable[[list[str]], str]) -> None:
        self._state.scalars.counters[counter] += count
        said = self._reported.setdefault(counter, set())
        new = sorted(set(names) - said)
        if new:
            said.update(new)
            warnings.warn(message(new), RuntimeWarning, stacklevel=5)

    def skipped_step(self) -> None:
        """A step the engine did not apply (DeepSpeed skipped it: fp16/bf16 overflow) and K-FAC undid: counted as
        ``skipped_steps``, not warned about (DeepSpeed logs each one)."""
        self._state.scalars.counters["skipped_steps"] += 1

    def nonfinite_factors(self, factors: list[str]) -> None:
        """Factor updates (``layer/A``, ``layer/G``; ``layer/S``, an eigenvalue correction) whose running average would
        not be finite."""
        cause = ""
        if self._factor_dtype == "float16":
            cause = (
                " factor_dtype is float16, which overflows above 65504 in storage and in communication: "
                "use bfloat16 or float32 if the factors are that large."
            )
        self._report(
            "nonfinite_factor_updates",
            len(factors),
            factors,
            lambda new: (
                f"K-FAC skipped non-finite factor updates of {new} (each keeps its previous running average).{cause}"
            ),
        )

    def unanswered_forwards(self, calls: dict[str, int]) -> None:
        """Forward calls in training mode whose output got no backward (their statistics were not counted)."""
        self._report(
            "forwards_without_backward",
            sum(calls.values()),
            calls,
            lambda new: (
                f"K-FAC ignored forward passes in training mode whose outputs got no backward "
                f"({ {name: calls[name] for name in new} } calls per layer; e.g. a metric computed without "
                f"torch.no_grad()): they do not enter A. Wrap such passes in torch.no_grad() or model.eval()"
            ),
        )

    def missing_layers(self, names: list[str]) -> None:
        """Layers whose hooks did not fire in a factor-update step."""
        passing = " (only scaled by the KL clip's factor nu, as every layer is)" if self._kl_clip else ""
        self._report(
            "missing_layer_updates",
            len(names),
            names,
            lambda new: (
                f"K-FAC layers whose hooks did not fire this step (called through a functional path, "
                f"unused, or without grad?): {new}; until they have factors their gradients are not "
                f"preconditioned{passing}"
            ),
        )

    def failed_decompositions(self, names: list[str]) -> None:
        """Layers whose candidate decomposition was rejected."""
        self._report(
            "failed_decompositions",
            len(names),
            names,
            lambda new: (
                f"K-FAC could not decompose {new} (a factor without a finite running average yet, see "
                f"any non-finite factor warning, or a decomposition that is not finite); keeping the previous "
                f"decomposition, or passing the gradient through before the first"
            ),
        )

    def uncurved_blocks(self, names: list[str], floor: float) -> None:
        """Layers whose new decomposition has no usable curvature for ``relative_damping`` (passed through)."""
        self._report(
            "uncurved_decompositions",
            len(names),
            names,
            lambda new: (
                f"K-FAC layers {new} have no usable curvature at this decomposition: with relative_damping their "
                f"mean curvature mean(eig A) * mean(eig G) is below {floor:.3g} (an all-zero or nearly zero A or G: "
                f"a dead layer, a gate initialised to 0, an all-zero input); their gradients pass through "
                f"unpreconditioned until a decomposition finds curvature (docs/conventions.md, Preconditioning)"
            ),
        )

    def step_without_backward(self, step: int, hooks: FactorCollector) -> None:
        """A ``step()`` that no backward through a registered layer preceded (skipped), said with what ``hooks`` saw:
        "step() called twice?" only where the layers ran before but neither forward nor backward since the last
        step. Neither counted nor warned about without hooks: with no layer registered no step has a backward, and
        construction said why, once (:func:`~ds_kfac.layers.find_layers`)."""
        if not hooks.hooked:
            return
        if not hooks.ever_fired:
            why = "yet (step() before the first forward and backward?)"
        elif hooks.forward_seen:
            why = "since the last step, though they ran forward with gradients enabled (a loss that does not use them?)"
        else:
            why = "since the last step, nor a forward (step() called twice?)"
        self._report(
            "steps_without_backward",
            1,
            [f"step {step}"],
            lambda new: (
                f"K-FAC step {step} skipped: no backward pass through its layers {why}; the gradients were left as "
                f"they are and the step count did not advance"
            ),
        )
