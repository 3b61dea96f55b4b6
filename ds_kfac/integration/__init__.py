"""Integration with DeepSpeed: ``initialize`` (:mod:`.initialize`), :class:`KFACEngine` (:mod:`.engine`),
:class:`KFACPipelineEngine` (:mod:`.pipeline`) and the end of a job (:mod:`.cleanup`).

Only :mod:`.cleanup` is imported here: it needs torch alone, so :func:`shutdown` also ends DeepSpeed-free
(DDP) jobs. The other two import DeepSpeed; ``ds_kfac`` loads them on first use.
"""

from .cleanup import release_deepspeed_shm, shutdown

__all__ = ["release_deepspeed_shm", "shutdown"]
