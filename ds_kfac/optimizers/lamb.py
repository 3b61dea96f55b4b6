"""Pure-PyTorch LAMB with the update rule and defaults of DeepSpeed's ``FusedLamb``.

DeepSpeed's ``FusedLamb`` is CUDA-only and needs a compiled extension; this class
reproduces its arithmetic (``csrc/lamb/fused_lamb_cuda_kernel.cu``) with
``torch._foreach`` ops so that it runs on any device and gives the same result.

For each parameter ``p`` with gradient ``g`` at its own step ``t`` (from 1)::

    g      = g / clip                    # clip = max(1, (||G|| + 1e-6) / max_grad_norm)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    u      = m / (sqrt(v) + eps) + weight_decay * p      # sqrt(v + eps) if eps_inside_sqrt
    coeff  = clamp(||p|| / ||u||, min_coeff, max_coeff) if ||p|| != 0 and ||u|| != 0 else 1
    step   = lr * sqrt(1 - beta2**t) / (1 - beta1**t)    # lr if not bias_correction
    p      = p - step * coeff * u

Quirks kept from DeepSpeed: ``m`` and ``v`` are never bias-corrected themselves;
the bias correction only scales the step *after* the trust ratio, so ``eps`` is
added to the uncorrected ``sqrt(v)`` and the trust ratio is computed on the
uncorrected update.  Weight decay is decoupled (added to the update, not to the
gradient).  The clamp applies ``max_coeff`` first and ``min_coeff`` last, so
``min_coeff`` wins if ``min_coeff > max_coeff``.  Gradient clipping (only when
``max_grad_norm > 0``) uses the L2 norm ``||G||`` of all gradients of the param
group, as DeepSpeed's FP16 wrappers pass per-group norms to ``FusedLamb``; with
a single param group this is global clipping.  The norm is over the gradients
this process holds; where gradients are sharded across ranks (tensor/pipeline
parallelism, ZeRO-2/3) use DeepSpeed's ``gradient_clipping`` instead.

Optimizer state (``exp_avg``, ``exp_avg_sq``) is kept in float32 for
half-precision parameters (float64 parameters keep float64 state); the
parameter itself is updated in its own dtype.

In a group flagged ``eigenbasis_moments`` (:mod:`.eigenbasis`) the gradient already is
``m / (sqrt(v) + eps)``, computed by K-FAC from moments kept in the layer's eigenbasis: the group keeps
no moments and takes it as the update before weight decay; the trust ratio and step size are as above.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from .common import ParamsT, check_hyperparameters, evaluate_closure, state_dtype
from .eigenbasis import GROUP_KEY

# Added to the gradient norm before dividing by ``max_grad_norm``, as FusedLamb does.
_CLIP_NORM_EPS = 1e-6
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class Lamb(torch.optim.Optimizer):
    """LAMB (https://arxiv.org/abs/1904.00962) matching DeepSpeed ``FusedLamb``.

    Args:
        params: parameters or param-group dicts to optimize.
        lr: learning rate.
        bias_correction: scale the step by ``sqrt(1 - beta2**t) / (1 - beta1**t)``.
        betas: decay rates of the first and second moment averages.
        eps: added to the denominator for numerical stability.
        eps_inside_sqrt: use ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        weight_decay: decoupled weight decay added to the update.
        max_grad_norm: clip each param group's gradient norm to this value (0 disables).
        max_coeff: upper bound of the trust ratio.
        min_coeff: lower bound of the trust ratio.
        amsgrad: not supported; ``True`` raises ``ValueError`` (as FusedLamb refuses it).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support amsgrad=True (DeepSpeed FusedLamb refuses the AMSGrad variant)")
        check_hyperparameters("Lamb", lr, eps, betas, weight_decay)
        if max_grad_norm < 0.0:
            raise ValueError(f"Lamb: invalid max_grad_norm {max_grad_norm}, must be >= 0 (0 disables clipping)")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self._lamb_coeffs: list[Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last ``step()``, one per updated parameter,
        in param-group then parameter order (as ``FusedLamb.get_lamb_coeffs``)."""
        return [float(c) for c in self._lamb_coeffs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but keep the moment estimates in
        their float32 state dtype (torch would cast them to e.g. a bf16 parameter's dtype)."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key in _MOMENT_KEYS:
                if key in saved_state.get(saved_id, {}):
                    self.state[p][key] = saved_state[saved_id][key].to(device=p.device, dtype=state_dtype(p))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = evaluate_closure(closure)
        self._lamb_coeffs = []
        for group in self.param_groups:
            self._lamb_coeffs.extend(self._step_group(group))
        return loss

    def _step_group(self, group: dict[str, Any]) -> list[Tensor]:
        """Update one param group; return its trust ratios in parameter order."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("Lamb does not support sparse gradients")
        if not params:
            return []

        # Bucket by (device, dtype, step) so each bucket is one set of foreach launches
        # with a single step size; ``index`` remembers the parameter order for the coeffs.
        buckets: dict[tuple[torch.device, torch.dtype, int], list[int]] = defaultdict(list)
        moments = not group.get(GROUP_KEY, False)
        for index, p in enumerate(params):
            state = self.state[p]
            if not state:
                state["step"] = 0
                for key in _MOMENT_KEYS if moments else ():
                    state[key] = torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            state["step"] += 1
            buckets[(p.device, p.dtype, state["step"])].append(index)
        grad_divisor = self._grad_clip_divisor(params, buckets.values(), group["max_grad_norm"])

        coeffs: dict[int, Tensor] = {}
        for (device, _, step), indices in buckets.items():
            bucket = [params[i] for i in indices]
            divisor = None if grad_divisor is None else grad_divisor.to(device)
            coeffs.update(zip(indices, self._update_bucket(bucket, group, step, divisor)))
        return [coeffs[i] for i in range(len(params))]

    @staticmethod
    def _grad_clip_divisor(
        params: list[Tensor], buckets: Iterable[list[int]], max_grad_norm: float
    ) -> Optional[Tensor]:
        """``max(1, (||G|| + 1e-6) / max_grad_norm)`` over the group's gradients, or
        ``None`` when clipping is off.  Kept as a tensor to avoid a host sync."""
        if max_grad_norm <= 0.0:
            return None
        device = params[0].device
        squared_norm = torch.zeros((), device=device)
        for indices in buckets:
            grads = [params[i].grad for i in indices]
            norms = torch._foreach_norm(grads, 2, dtype=torch.promote_types(grads[0].dtype, torch.float32))
            squared_norm = squared_norm + torch.stack(norms).square().sum().to(device)
        norm = squared_norm.sqrt()
        return ((norm + _CLIP_NORM_EPS) / max_grad_norm).clamp(min=1.0)

    def _update_bucket(
        self, params: list[Tensor], group: dict[str, Any], step: int, grad_divisor: Optional[Tensor]
    ) -> list[Tensor]:
        """LAMB update of same-device, same-dtype, same-step parameters; returns their trust ratios."""
        beta1, beta2 = group["betas"]
        compute_dtype = state_dtype(params[0])
        # Working copies in the state dtype; ``.to`` returns the tensor itself when the
        # dtype already matches, so full-precision parameters are updated in place below.
        weights = [p.to(compute_dtype) for p in params]
        grads = [p.grad.to(compute_dtype) for p in params]
        if grad_divisor is not None:
            grads = torch._foreach_div(grads, grad_divisor.to(compute_dtype))

        if group.get(GROUP_KEY, False):
            updates = [g.clone() for g in grads]  # K-FAC's m / (sqrt(v) + eps), taken in the eigenbasis
        else:
            updates = self._moment_updates(params, grads, group)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, weights, alpha=group["weight_decay"])

        weight_norms = torch.stack(torch._foreach_norm(weights))
        update_norms = torch.stack(torch._foreach_norm(updates))
        ratios = (weight_norms / update_norms).clamp(max=group["max_coeff"]).clamp(min=group["min_coeff"])
        coeffs = torch.where((weight_norms != 0) & (update_norms != 0), ratios, torch.ones_like(ratios))

        if group["bias_correction"]:
            step_size = group["lr"] * (1.0 - beta2**step) ** 0.5 / (1.0 - beta1**step)
        else:
            step_size = group["lr"]
        torch._foreach_mul_(updates, list((coeffs * -step_size).unbind()))
        torch._foreach_add_(weights, updates)
        low_precision = [(p, w) for p, w in zip(params, weights) if p is not w]
        if low_precision:
            torch._foreach_copy_([p for p, _ in low_precision], [w for _, w in low_precision])
        return list(coeffs.unbind())

    def _moment_updates(self, params: list[Tensor], grads: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Fold ``grads`` into the parameters' moments and return ``m / (sqrt(v) + eps)`` (new tensors)."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        if group["eps_inside_sqrt"]:
            denoms = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, group["eps"]))
        else:
            denoms = torch._foreach_add(torch._foreach_sqrt(exp_avg_sqs), group["eps"])
        return torch._foreach_div(exp_avgs, denoms)
