"""Param groups whose per-element moments K-FAC keeps in its eigenbasis (``"eigenbasis_moments": true``).

With the key on, K-FAC turns each preconditioned layer's gradient into the base optimizer's normalised
direction, computed from moments kept in the layer's eigenbasis (:mod:`ds_kfac.curvature.moments`). The base
optimizer must then apply that direction as it is: its groups holding those layers' parameters carry
``GROUP_KEY: True`` (:func:`split_groups`), and :class:`~ds_kfac.optimizers.Lamb` and
:class:`~ds_kfac.optimizers.Adam` skip their own moments there, keeping the rest of their rule in the parameter
basis (weight decay, LAMB's trust ratio and step size, the learning rate). :func:`moment_settings` tells K-FAC
which per-element rule to apply in the eigenbasis, so that with the identity as basis the update is the
optimizer's own.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

GROUP_KEY = "eigenbasis_moments"
"""The param-group flag: this group's gradients are K-FAC's normalised directions, applied as they are."""


def split_groups(params: Iterable[Any], preconditioned: Iterable[Tensor]) -> list[dict[str, Any]]:
    """``params`` (tensors or param-group dicts) as param groups, each group split in two: the parameters in
    ``preconditioned`` (flagged with :data:`GROUP_KEY`, the group's other settings kept) and the others.
    Empty halves are left out; the order of parameters within each half is kept."""
    chosen = {id(p) for p in preconditioned}
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    split = []
    for group in groups:
        if not isinstance(group, dict):
            raise TypeError("model_parameters mixes tensors and param-group dicts")
        members = group["params"]
        members = [members] if isinstance(members, Tensor) else list(members)
        settings = {k: v for k, v in group.items() if k != "params"}
        mine = [p for p in members if id(p) in chosen]
        rest = [p for p in members if id(p) not in chosen]
        if mine:
            split.append({**settings, "params": mine, GROUP_KEY: True})
        if rest:
            split.append({**settings, "params": rest})
    return split


def moment_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The per-element rule ``optimizer`` applies, which K-FAC applies in the eigenbasis instead: ``beta1``,
    ``beta2``, ``eps``, ``eps_inside_sqrt`` and ``bias_correction`` (whether the direction itself is
    bias-corrected: Adam's; LAMB bias-corrects its step size instead). Read from the flagged groups, which must
    agree; ``ValueError`` naming what is wrong otherwise."""
    from .adam import Adam
    from .lamb import Lamb

    if not isinstance(optimizer, (Lamb, Adam)):
        raise ValueError(
            f"kfac.eigenbasis_moments needs a base optimizer that applies K-FAC's directions as they are: "
            f"ds_kfac.optimizers.Lamb or ds_kfac.optimizers.Adam (the JSON types Lamb, Adam and AdamW), "
            f"got {type(optimizer).__qualname__}"
        )
    flagged = [g for g in optimizer.param_groups if g.get(GROUP_KEY)]
    if not flagged:
        raise ValueError(
            f"kfac.eigenbasis_moments: no param group of the {type(optimizer).__name__} optimizer is flagged "
            f"{GROUP_KEY!r}: build its groups with ds_kfac.optimizers.split_groups(params, the K-FAC layers' "
            f"parameters)"
        )
    lamb = isinstance(optimizer, Lamb)
    rules = set()
    for group in flagged:
        beta1, beta2 = group["betas"]
        inside = group["eps_inside_sqrt"] if lamb else False
        corrected = False if lamb else group["bias_correction"]
        rules.add((beta1, beta2, group["eps"], inside, corrected))
        if lamb and group["max_grad_norm"] > 0:
            raise ValueError(
                f"kfac.eigenbasis_moments with LAMB's max_grad_norm={group['max_grad_norm']} in a group of K-FAC "
                f"layers: the optimizer would clip K-FAC's directions, not gradients; clip the gradients before "
                f"K-FAC (DeepSpeed's gradient_clipping, which K-FAC then applies itself)"
            )
        if not lamb and group["weight_decay"] and not group["decoupled_weight_decay"]:
            raise ValueError(
                "kfac.eigenbasis_moments with Adam's L2 weight decay (adam_w_mode false, weight_decay > 0) in a "
                "group of K-FAC layers: K-FAC's moments see gradients without it; use decoupled weight decay "
                "(AdamW, adam_w_mode true)"
            )
    if len(rules) > 1:
        raise ValueError(
            f"kfac.eigenbasis_moments: the K-FAC layers' param groups disagree on betas, eps or bias correction "
            f"({sorted(rules)}): a layer's weight and bias share one set of moments, so these must be equal"
        )
    beta1, beta2, eps, inside, corrected = rules.pop()
    return dict(beta1=beta1, beta2=beta2, eps=eps, eps_inside_sqrt=inside, bias_correction=corrected)
