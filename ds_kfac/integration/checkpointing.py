"""One checkpoint protocol for every ds_kfac engine: :class:`CheckpointMixin`.

Each engine keeps files of its own in DeepSpeed's tag directory (K-FAC's state, EASGD's per-rank weights). On
save they are written atomically before DeepSpeed writes anything (so before its ``latest`` file names the new
tag). On load the tag is resolved as DeepSpeed will, a ZeRO stage or world size DeepSpeed cannot load across is
refused, and every file is read and checked on every rank before DeepSpeed loads anything: a ``ValueError`` then
leaves the engine as it was. ``load_optimizer_states=False`` or ``load_module_only=True`` read none of them.

An engine class adds its part through three hooks, each calling ``super()`` so that mixed engines
(:class:`~ds_kfac.integration.easgd.KFACEASGDEngine`) chain them: :meth:`_states_to_save`,
:meth:`_read_checkpoint` and :meth:`_load_fresh`.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from .files import refuse_unloadable, save_atomic, tag_to_load, tag_to_save

Installer = Callable[[], None]
"""Puts one part's checked state in place, once DeepSpeed has loaded its own."""


class CheckpointMixin:
    """``save_checkpoint`` and ``load_checkpoint`` around those of the ``DeepSpeedEngine`` it is mixed into
    before (see the module docstring)."""

    def save_checkpoint(
        self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None, **kwargs: Any
    ) -> Any:
        """``DeepSpeedEngine.save_checkpoint``, with this rank's own files (:meth:`_states_to_save`) written first
        in ``<save_dir>/<tag>/``."""
        tag = tag_to_save(self, tag)
        for name, state in self._states_to_save().items():
            save_atomic(state, os.path.join(save_dir, tag, name))
        return super().save_checkpoint(save_dir, tag, client_state=client_state or {}, **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[Optional[str], Optional[dict]]:
        """``DeepSpeedEngine.load_checkpoint``, this engine's own files read and checked before it
        (:meth:`_read_checkpoint`) and put in place after it. DeepSpeed files this engine cannot load, saved at
        another ZeRO stage or with ZeRO optimizer states at another world size
        (:func:`~ds_kfac.integration.files.refuse_unloadable`), raise a ``ValueError`` first."""
        fresh = kwargs.get("load_module_only", False) or not kwargs.get("load_optimizer_states", True)
        tag = tag_to_load(self, load_dir, tag)
        if tag is not None:
            refuse_unloadable(self, os.path.join(load_dir, tag), optimizer_states=not fresh)
        if fresh or tag is None:  # fresh; or no checkpoint named: DeepSpeed warns and loads nothing
            loaded = super().load_checkpoint(load_dir, tag, **kwargs)
            if fresh:
                self._load_fresh()
            return loaded
        installers = self._read_checkpoint(os.path.join(load_dir, tag))
        path, client_state = super().load_checkpoint(load_dir, tag, **kwargs)
        if path is not None:
            for install in installers:
                install()
        return path, client_state

    def _states_to_save(self) -> dict[str, Any]:
        """This rank's files to write in the tag directory, by name (none here)."""
        return {}

    def _read_checkpoint(self, checkpoint: str) -> list[Installer]:
        """Read and check this engine's files in tag directory ``checkpoint`` (a ``ValueError`` otherwise); what
        puts each in place after DeepSpeed's load (nothing here)."""
        return []

    def _load_fresh(self) -> None:
        """After DeepSpeed loaded the weights only (``load_optimizer_states=False``, ``load_module_only=True``):
        nothing here."""
