"""The module hooks that gather each layer's factors, step 1 of the flow.

A forward hook computes the layer's ``A`` statistic of that call and hangs a
hook on the output; only when the output's gradient arrives is the ``A``
statistic counted, together with ``G``. So a forward pass whose output never
gets a backward (a metric computed in training mode, a recomputation by
non-reentrant activation checkpointing) contributes nothing, and ``A`` and
``G`` always count the same calls.

What a forward call keeps and how its statistics are counted is the block's
(:meth:`~ds_kfac.curvature.CurvatureBlock.forward_statistic`,
:meth:`~ds_kfac.curvature.CurvatureBlock.backward_statistic`): for a Kronecker
block the ``A`` statistic (or, with the eigenvalue correction, the input), for
a unit-wise BatchNorm block the normalized input.

With the sampled Fisher, ``G`` comes from an extra backward pass of a loss
with sampled targets (:meth:`FactorCollector.sampled_backward`): the hooks
count the statistics of that pass only, and the training loss's backward
passes through them.

The collector also records what the step checks before preconditioning:
whether any registered layer received a backward since the step began
(:attr:`FactorCollector.backward_seen`), whether its hooks ever ran
(:attr:`FactorCollector.ever_fired`, false for a model running a compiled
graph built without them), and the forward calls of this step that got no
backward (:meth:`FactorCollector.unanswered`).
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from ..curvature import CurvatureBlock
from ..layers import LayerAdapter
from ..placement import Distributor
from ..timing import PhaseTimer

LossScale = Callable[[], Union[float, torch.Tensor]]

compile_reason = (
    "K-FAC's module hooks run eagerly (one graph break per registered layer), so torch.compile(fullgraph=True) "
    "cannot compile a model with K-FAC attached: compile it with fullgraph=False, after attaching K-FAC"
)


ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
"""The name of a leaf's backward node (a parameter's, when it is an input of the node that made the output)."""


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread: a forward call then is a
    recomputation (activation checkpointing). ``torch._C._current_graph_task_id`` is what
    ``torch.utils.checkpoint`` itself uses to tell (listed in docs/maintainers.md)."""
    return torch._C._current_graph_task_id() != -1


class FactorCollector:
    """Module hooks on every block's layer: micro-batch factors in, complete step statistics out.

    Args:
        blocks: the curvature blocks whose layers get hooks.
        distributor: says which layers this rank collects and takes each layer's finished statistics.
        timer: accounts the hooks' time to the ``hooks`` phase.
        accumulation_steps: micro-batches per optimizer step (the ``G`` scaling undoes the loss's division).
        loss_scale: the loss scale of the micro-batch being back-propagated (1 when ``None``).
        last_micro_batch: whether the micro-batch being back-propagated ends the optimizer step; with it,
            each layer's statistics go to the distributor as soon as its last backward of the step ran.
        relays: tensor-parallel layers whose factors another rank of their group holds (``exact``): their hooks
            send this rank's rows to it (:mod:`ds_kfac.layers.tensor_parallel`), whenever the owner's hooks
            compute statistics, so the collectives match.
        factor_micro_batches: gather factors only in the last this many micro-batches of a factor-update step
            (``None``: all of them); the earlier ones run no statistic.
        micro_batch: the index (0-based) within the optimizer step of the micro-batch whose forward pass is
            running; required when ``factor_micro_batches`` is fewer than ``accumulation_steps``.
        sampled: take the statistics from :meth:`sampled_backward` only (``fisher: "sampled"``).
    """

    def __init__(
        self,
        blocks: list[CurvatureBlock],
        distributor: Distributor,
        timer: PhaseTimer,
        *,
        accumulation_steps: int,
        loss_scale: Optional[LossScale],
        last_micro_batch: Optional[Callable[[], bool]],
        relays: Sequence[LayerAdapter] = (),
        factor_micro_batches: Optional[int] = None,
        micro_batch: Optional[Callable[[], int]] = None,
        sampled: bool = False,
    ) -> None:
        self.distributor = distributor
        self.sampled = sampled
        """Whether the statistics come from :meth:`sampled_backward` (the sampled Fisher), not the training loss."""
        self.sampling = False
        """Whether :meth:`sampled_backward`'s pass is running."""
        self.sampled_passes = 0
        """Sampled backward passes that reached registered layers since :meth:`arm`."""
        # Outputs whose statistics await the sampled pass, with the hook that counts them.
        self._awaiting: list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]] = []
        self.timer = timer
        self.accumulation_steps = accumulation_steps
        self.loss_scale = loss_scale
        self.last_micro_batch = last_micro_batch
        self.collecting = True
        self._first_collected = accumulation_steps - min(factor_micro_batches or accumulation_steps, accumulation_steps)
        self._micro_batch = micro_batch
        self.backward_seen = False
        """Whether some registered layer's output received a gradient since :meth:`arm`."""
        self.ever_fired = False
        """Whether any hook ever ran since the collector was built."""
        self.forward_seen = False
        """Whether some registered layer ran forward with gradients enabled since :meth:`arm`."""
        self.hooked = bool(blocks) or bool(relays)
        """Whether any layer has hooks: without (no layer registered), no step is ever preceded by a backward."""
        self._forwards: Counter[str] = Counter()  # this step's forward calls that can get a backward
        self._backwards: Counter[str] = Counter()
        hook = torch.compiler.disable(self._forward_hook, reason=compile_reason)
        for block in blocks:
            block.adapter.module.register_forward_hook(partial(hook, block))
        relay = torch.compiler.disable(self._relay_forward_hook, reason=compile_reason)
        for adapter in relays:
            adapter.module.register_forward_hook(partial(relay, adapter))

    def arm(self, collecting: bool) -> None:
        """Start a step: gather factors during it or not."""
        self.collecting = collecting
        self.backward_seen = self.forward_seen = False
        self.sampled_passes = 0
        self.discard()

    def _gathering(self, module: nn.Module) -> bool:
        """Whether the forward pass in progress gathers factors: a training-mode call during a factor-update
        step, in one of its last ``factor_micro_batches`` micro-batches."""
        if not (self.collecting and module.training):
            return False
        return self._first_collected == 0 or self._micro_batch() >= self._first_collected

    def discard(self) -> None:
        """Forget this step's call counts (its statistics are taken or dropped)."""
        self._forwards.clear()
        self._backwards.clear()
        self._awaiting = []

    def unanswered(self) -> dict[str, int]:
        """Per layer, this step's forward calls whose output got no backward (e.g. a metric computed
        in training mode without ``torch.no_grad()``); their statistics were not counted."""
        return {name: n - self._backwards[name] for name, n in self._forwards.items() if n > self._backwards[name]}

    def _forward_hook(self, block: CurvatureBlock, module: nn.Module, inputs: tuple, output: Any) -> None:
        output = block.adapter.output_of(output)
        if not (torch.is_grad_enabled() and output is not None and output.requires_grad):
            return
        self.ever_fired = self.forward_seen = True
        if not (self._gathering(module) and self.distributor.collects(block)):
            if not self.backward_seen:
                output.register_hook(self._mark_backward)
            return
        with self.timer.phase("hooks"):
            x = inputs[0]
            pending = block.forward_statistic(x)
            if not _in_backward():  # a recomputation stands in for a forward already counted
                self._forwards[block.name] += 1
            hook = partial(self._output_grad_hook, block, block.adapter.batch_size(x), pending)
            output.register_hook(hook)
            if self.sampled:
                self._awaiting.append((output, hook))

    def sampled_backward(self, output: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Back-propagate ``loss(output)`` (targets sampled from the model) to the outputs of the registered layers'
        calls since the last such pass, so that their hooks count this pass's statistics. Returns whether any call
        awaited it (none: not a micro-batch that gathers factors, or a forward outside training mode), and only
        then computes the loss.

        ``loss`` is taken of a detached copy of ``output``; its gradient enters the graph below ``output``: the
        backward node that made ``output`` is called directly, and ``torch.autograd.grad`` goes on from that node's
        inputs to the awaiting outputs only, keeping the graph for the training loss's backward. So hooks on
        ``output`` itself (DeepSpeed's engine hooks its forward's outputs to start its gradient reduction) do not
        run, no parameter's ``.grad`` is touched, and of the weight gradients only that node's (discarded) is
        computed. An awaiting output that is ``output`` itself gets its hook called with the loss's gradient."""
        awaiting, self._awaiting = self._awaiting, []
        if not awaiting:
            return False
        if output.grad_fn is None or output.output_nr != 0:
            raise ValueError(
                "sample_fisher needs the model's output as its forward made it (a tensor with a backward node, the "
                "node's first output): not a detached tensor, nor one output of a multi-output operation"
            )
        leaf = output.detach().requires_grad_()
        with torch.enable_grad():
            (root,) = torch.autograd.grad(loss(leaf), leaf)
        root = root.to(output.dtype)
        node = output.grad_fn
        self.sampling = True
        try:
            inner = []
            for out, hook in awaiting:
                if out.grad_fn is node and out.output_nr == 0:
                    hook(root)
                else:
                    inner.append(out)
            if inner:
                # A built-in op's node is called (one input: a tensor, others a tuple); a custom autograd Function's
                # (DeepSpeed's ZeRO 3 linear, fused kernels) through its ``apply``, one gradient per forward input.
                grads = node(root) if callable(node) else node.apply(root)
                below = [  # the node's inputs but parameters (leaves, whose gradient the engine would sum to shape)
                    (GradientEdge(fn, nr), grad)
                    for (fn, nr), grad in zip(node.next_functions, (grads,) if torch.is_tensor(grads) else grads)
                    if fn is not None and grad is not None and fn.name() != ACCUMULATE_GRAD
                ]
                torch.autograd.grad(
                    [edge for edge, _ in below],
                    inner,
                    grad_outputs=[grad for _, grad in below],
                    retain_graph=True,
                    allow_unused=True,
                )
        finally:
            self.sampling = False
        self.sampled_passes += 1
        return True

    def _relay_forward_hook(self, adapter: LayerAdapter, module: nn.Module, inputs: tuple, output: Any) -> None:
        """:meth:`_forward_hook` of a layer whose factors another rank holds: send it this rank's rows."""
        output = adapter.output_of(output)
        if not (torch.is_grad_enabled() and output is not None and output.requires_grad):
            return
        self.ever_fired = self.forward_seen = True
        if not self._gathering(module):
            if not self.backward_seen:
                output.register_hook(self._mark_backward)
            return
        with self.timer.phase("hooks"):
            adapter.input_rows(inputs[0])
            output.register_hook(partial(self._relay_grad_hook, adapter))

    def _relay_grad_hook(self, adapter: LayerAdapter, grad: torch.Tensor) -> None:
        with self.timer.phase("hooks"):
            self.backward_seen = True
            adapter.output_grad_rows(grad)

    def _mark_backward(self, grad: torch.Tensor) -> None:
        self.backward_seen = True

    def _output_grad_hook(self, block: CurvatureBlock, batch_size: int, pending: Any, grad: torch.Tensor) -> None:
        """Count the call's statistics: ``pending`` from its forward, and ``grad``, the gradient of its output."""
        with self.timer.phase("hooks"):
            self.backward_seen = True
            if self.sampled and not self.sampling:
                # The training loss's backward: G is the sampled pass's, which can no longer run on the calls before
                # it. The statistics are handed over from here, where the accumulation boundary is known
                # (accelerate sets it only in its backward).
                self._awaiting = []
                self._hand_over_when_complete(block)
                return
            if self.distributor.handed_over(block):
                raise RuntimeError(
                    f"K-FAC layer {block.name!r} ran again after its factors for this step were final and sent "
                    f"(at the last micro-batch's backward). If one optimizer step runs several forward/backward "
                    f"passes, pass accumulation_steps (and boundary), or set overlap_factor_comm to false"
                )
            # c = B * accumulation_steps / loss_scale: per-example gradients of the unscaled loss.
            scale = self.loss_scale() if self.loss_scale is not None else 1.0
            block.backward_statistic(pending, grad, batch_size, batch_size * self.accumulation_steps / scale)
            self._backwards[block.name] += 1
            if not self.sampled:
                self._hand_over_when_complete(block)

    def _hand_over_when_complete(self, block: CurvatureBlock) -> None:
        """Hand the layer's statistics to the reduction if they are complete: in the last micro-batch, once every
        counted forward call of the step has had its backward (a layer called several times per micro-batch waits
        for its last call; under reentrant checkpointing every forward runs inside the backward and none is
        counted)."""
        done = self.last_micro_batch is not None and self._backwards[block.name] >= self._forwards[block.name]
        if done and self.last_micro_batch() and not self.distributor.handed_over(block):
            self.distributor.statistics_ready(block)
