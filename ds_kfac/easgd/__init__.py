"""Synchronous EASGD (You, Buluç, Demmel, SC'17): each data-parallel rank trains its own weights, tied to a
center variable by an elastic force; one packed all-reduce of the weights per ``period`` steps, overlapped with
the forward and backward passes, and deterministic. The update is in docs/conventions.md ("EASGD").

This package holds the config section (:class:`EASGDConfig`) and the update (:class:`ElasticAverager`); the
DeepSpeed engine that uses them is in :mod:`ds_kfac.integration.easgd`.
"""

from .averager import ElasticAverager
from .config import EASGDConfig

__all__ = ["EASGDConfig", "ElasticAverager"]
