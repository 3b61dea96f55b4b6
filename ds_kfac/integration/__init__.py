"""Integration with the DeepSpeed engine: ``initialize`` and :class:`KFACEngine`."""

from .cleanup import release_deepspeed_shm
from .engine import STATE_FILE, KFACEngine
from .initialize import add_config_arguments, initialize

__all__ = ["STATE_FILE", "KFACEngine", "add_config_arguments", "initialize", "release_deepspeed_shm"]
