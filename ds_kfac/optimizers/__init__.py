"""Base optimizers that K-FAC preconditioned gradients are handed to.

:class:`Lamb` is a pure-PyTorch LAMB with DeepSpeed ``FusedLamb`` semantics;
:class:`Adam` is Adam/AdamW with ``torch.optim.Adam``'s rule;
:func:`resolve_lamb` picks a fused implementation when one can run;
:func:`build_optimizer` builds the DeepSpeed JSON ``"optimizer"`` section;
:func:`build_client_optimizer` builds a ``"client_optimizer"`` section (any ``torch.optim.Optimizer`` by its
dotted path, random draws alike on every rank);
:func:`split_groups` flags the groups whose moments K-FAC keeps in its eigenbasis (:mod:`.eigenbasis`).
"""

from .adam import Adam
from .client import build_client_optimizer
from .eigenbasis import GROUP_KEY, moment_settings, split_groups
from .lamb import Lamb
from .resolve import build_optimizer, resolve_lamb

__all__ = [
    "Adam",
    "GROUP_KEY",
    "Lamb",
    "build_client_optimizer",
    "build_optimizer",
    "moment_settings",
    "resolve_lamb",
    "split_groups",
]
