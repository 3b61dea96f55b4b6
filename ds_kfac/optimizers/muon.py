"""DeepSpeed's Muon for the matrices K-FAC leaves, the key's Adam for K-FAC's layers.

DeepSpeed's JSON ``"Muon"`` optimizer steps the hidden weight matrices by Muon (momentum, then the polar factor
by Newton-Schulz, scaled by the matrix's aspect ratio) and every other parameter by Adam. With
``eigenbasis_moments`` the layers K-FAC registers take the key's Adam instead, whichever half DeepSpeed would have
put them in: their groups are flagged (:mod:`.eigenbasis`) and take K-FAC's direction as it is, as in
:class:`~ds_kfac.optimizers.Adam`. A group with ``use_muon: True`` takes, for each parameter ``p`` with
gradient ``g`` and momentum buffer ``b``, DeepSpeed's own update (``deepspeed`` 0.19.8's ``muon_update``)::

    p = p * (1 - lr * weight_decay) - lr * muon_update(g, b, momentum)

It runs eagerly (``torch.compiler.set_stance("force_eager")``): DeepSpeed compiles it, which cost 3-12 s at the
first step on this CPU (most on a cold inductor cache) for no speed on the few matrices K-FAC leaves (3.3 ms a step
eager against 3.4 compiled on the BERT demo's three); eager results differ from compiled ones in the last bits.

Which parameters Muon takes is decided by :func:`muon_groups` as DeepSpeed decides it (two or more dimensions,
no ``embed`` or ``lm_head`` in the name), less those K-FAC registers."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .adam import Adam
from .common import ParamsT
from .eigenbasis import GROUP_KEY

MUON_KEY = "use_muon"
"""The param-group flag of DeepSpeed's Muon: this group steps by Muon."""
MUON_HALF = ("lr", "momentum", "weight_decay")
"""The settings a Muon group reads."""


def takes_muon(name: str, param: Tensor) -> bool:
    """DeepSpeed's rule (``deepspeed.set_optimizer_flags``): Muon for a matrix that is not an embedding or head."""
    return param.dim() >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def muon_groups(
    groups: list[dict[str, Any]], names: dict[int, str], muon: dict[str, Any], adam: dict[str, Any]
) -> list[dict[str, Any]]:
    """``groups`` (flagged or not by :func:`~ds_kfac.optimizers.split_groups`) as DeepSpeed's Muon groups: each
    unflagged group split into a Muon half (``muon`` settings, the parameters :func:`takes_muon` picks by their
    ``names``) and an Adam half (``adam`` settings); flagged groups take ``adam``'s settings whole. A group's own
    settings (``weight_decay: 0`` for biases) override both, as DeepSpeed's engine does."""
    out = []
    for group in groups:
        own = {k: v for k, v in group.items() if k != "params"}
        members = list(group["params"])
        hidden = [] if group.get(GROUP_KEY) else [p for p in members if takes_muon(names[id(p)], p)]
        chosen = {id(p) for p in hidden}
        rest = [p for p in members if id(p) not in chosen]
        if hidden:
            out.append({**muon, **{k: v for k, v in own.items() if k in MUON_HALF}, "params": hidden, MUON_KEY: True})
        if rest:
            out.append({**adam, **own, "params": rest})
    return out


class Muon(Adam):
    """Adam (:class:`~ds_kfac.optimizers.Adam`'s rule and flagged groups) whose groups with ``use_muon: True`` step
    by DeepSpeed's Muon; see the module docstring. ``momentum`` is the Muon groups' momentum."""

    def __init__(self, params: ParamsT, momentum: float = 0.95, **adam: Any) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        super().__init__(params, **adam)
        for group in self.param_groups:
            group.setdefault("momentum", momentum)
            group.setdefault(MUON_KEY, False)

    def _update(self, p: Tensor, group: dict[str, Any], direction_given: bool) -> None:
        """One parameter's update: Muon's in a ``use_muon`` group, else Adam's."""
        if group[MUON_KEY]:
            self._muon(p, group)
        else:
            super()._update(p, group, direction_given)

    def _muon(self, p: Tensor, group: dict[str, Any]) -> None:
        """One matrix's Muon update."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        # Imported on first use (the import compiles Muon's kernels), as resolve.py imports the fused LAMBs.
        from deepspeed.runtime.zero.muon.original_muon import muon_update

        with torch.compiler.set_stance("force_eager"):  # see the module docstring
            update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(update.reshape(p.shape), alpha=-group["lr"])


MUON_JSON_KEYS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "betas", "eps", "torch_adam")
"""The JSON ``Muon`` keys this optimizer reads (DeepSpeed's, less ``ns_method`` and ``adam_w_mode``: the Gram
Newton-Schulz and decoupled weight decay, DeepSpeed's defaults)."""


def build_muon(groups: list[dict[str, Any]], names: dict[int, str], params_dict: dict[str, Any]) -> Muon:
    """The JSON ``"Muon"`` optimizer over ``groups``, its settings resolved as DeepSpeed's engine resolves them:
    the shared value, then ``muon_lr`` / ``adam_lr``, then the group's own."""
    unknown = sorted(set(params_dict) - set(MUON_JSON_KEYS))
    if unknown:
        raise ValueError(f"optimizer type 'Muon': unknown keys {unknown}; allowed: {list(MUON_JSON_KEYS)}")
    shared = {k: params_dict[k] for k in ("lr", "weight_decay") if k in params_dict}
    muon = {**shared, **({"lr": params_dict["muon_lr"]} if "muon_lr" in params_dict else {})}
    adam = {**shared, **({"lr": params_dict["adam_lr"]} if "adam_lr" in params_dict else {})}
    for key in ("betas", "eps"):
        if key in params_dict:
            adam[key] = tuple(params_dict[key]) if key == "betas" else params_dict[key]
    if "momentum" in params_dict:
        muon["momentum"] = params_dict["momentum"]
    return Muon(muon_groups(groups, names, muon, adam))
