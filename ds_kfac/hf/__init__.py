"""Hugging Face integration: :class:`KFACTrainer`, a drop-in ``transformers.Trainer``.

Importing this package imports ``transformers`` and ``accelerate``; ``import ds_kfac`` does not.
"""

from .trainer import KFACTrainer

__all__ = ["KFACTrainer"]
