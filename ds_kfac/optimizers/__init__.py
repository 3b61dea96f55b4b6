"""Base optimizers that K-FAC preconditioned gradients are handed to.

:class:`Lamb` is a pure-PyTorch LAMB with DeepSpeed ``FusedLamb`` semantics;
:func:`resolve_lamb` picks a fused implementation when one can run;
:func:`build_optimizer` builds the DeepSpeed JSON ``"optimizer"`` section.
"""

from .lamb import Lamb
from .resolve import build_optimizer, resolve_lamb

__all__ = ["Lamb", "build_optimizer", "resolve_lamb"]
