"""Adam and AdamW with ``torch.optim.Adam``'s update rule, which also apply K-FAC's eigenbasis directions.

For each parameter ``p`` with gradient ``g`` at its own step ``t`` (from 1), as ``torch.optim.Adam`` (and
DeepSpeed's ``FusedAdam``)::

    p      = p * (1 - lr * weight_decay)          # decoupled (AdamW, adam_w_mode); else g = g + weight_decay * p
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    p      = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)   # without bias_correction:
                                                                                  # p - lr * m / (sqrt(v) + eps)

In a group flagged ``eigenbasis_moments`` (:mod:`.eigenbasis`) the gradient already is that normalised
direction ``d``, computed by K-FAC from moments kept in the layer's eigenbasis: the group keeps no moments and
takes ``p = p * (1 - lr * weight_decay) - lr * d``.

DeepSpeed builds its own Adam for a JSON ``"Adam"``/``"AdamW"`` optimizer; ``ds_kfac.initialize`` builds this
one instead only when ``eigenbasis_moments`` needs it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .common import ParamsT, check_hyperparameters, evaluate_closure, state_dtype
from .eigenbasis import GROUP_KEY


class Adam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW (``True``) as ``torch.optim.Adam``; see the module
    docstring for the rule and for the groups flagged ``eigenbasis_moments``.

    Args:
        params: parameters or param-group dicts to optimize.
        lr: learning rate.
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator.
        weight_decay: weight decay, decoupled or L2 as ``decoupled_weight_decay`` says.
        decoupled_weight_decay: AdamW's decoupled weight decay (DeepSpeed's ``adam_w_mode``).
        bias_correction: divide the moments by ``1 - beta**t`` (DeepSpeed ``FusedAdam``'s key; torch always does).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        bias_correction: bool = True,
    ) -> None:
        check_hyperparameters("Adam", lr, eps, betas, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Apply one update to every parameter that has a gradient."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            given = bool(group.get(GROUP_KEY, False))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                self._update(p, group, given)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], direction_given: bool) -> None:
        """One parameter's update; ``direction_given``: its gradient is K-FAC's normalised direction."""
        lr, decay = group["lr"], group["weight_decay"]
        dtype = state_dtype(p)
        weight = p.to(dtype)
        grad = p.grad.to(dtype)
        if decay != 0.0 and group["decoupled_weight_decay"]:
            weight.mul_(1.0 - lr * decay)
        if direction_given:
            weight.add_(grad, alpha=-lr)
        else:
            if decay != 0.0 and not group["decoupled_weight_decay"]:
                grad = grad.add(weight, alpha=decay)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
            m.lerp_(grad, 1.0 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            if group["bias_correction"]:
                denom = (v.sqrt() / (1.0 - beta2**t) ** 0.5).add_(group["eps"])
                weight.addcdiv_(m, denom, value=-lr / (1.0 - beta1**t))
            else:
                weight.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-lr)
        if weight is not p:
            p.copy_(weight)
