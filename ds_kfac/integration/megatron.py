"""Megatron-core tensor parallelism: adapters for ``ColumnParallelLinear`` and ``RowParallelLinear``, and the
``mpu`` that DeepSpeed's engine gets for ``megatron.core.parallel_state``.

Imported by :func:`ds_kfac.layers.find_layers` once ``megatron.core.tensor_parallel`` is imported (never by
``import ds_kfac``); importing it registers the adapters (:func:`ds_kfac.register_adapter`). It needs torch and
megatron-core, not DeepSpeed. The Megatron internals read here are listed in docs/maintainers.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from ..layers import UnsupportedLayerError, register_adapter
from ..layers.tensor_parallel import TensorParallelAdapter, TensorParallelFactors


def _refuse(module: Any, what: str) -> None:
    raise UnsupportedLayerError(f"{type(module).__name__} with {what} (K-FAC supports the layer without it)")


class _MegatronAdapter(TensorParallelAdapter):
    """What both Megatron layers share: the group (``tp_group``), the full sizes, and the refused variants."""

    def __init__(self, module: Any, tensor_parallel_factors: TensorParallelFactors = "exact") -> None:
        if module.sequence_parallel:
            _refuse(module, "sequence_parallel=True (inputs or outputs split along the sequence)")
        if module.is_expert:
            _refuse(module, "is_expert=True (mixture-of-experts layers)")
        super().__init__(module, tensor_parallel_factors)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.module.tp_group

    @property
    def in_features(self) -> int:
        return self.module.input_size

    @property
    def out_features(self) -> int:
        return self.module.output_size


class ColumnParallelAdapter(_MegatronAdapter):
    """``ColumnParallelLinear`` with ``gather_output=False``: output features split, input whole."""

    partition = "output"

    def __init__(self, module: ColumnParallelLinear, tensor_parallel_factors: TensorParallelFactors = "exact") -> None:
        if module.gather_output:
            _refuse(module, "gather_output=True")
        super().__init__(module, tensor_parallel_factors)


class RowParallelAdapter(_MegatronAdapter):
    """``RowParallelLinear`` with ``input_is_parallel=True``: input features split, output summed, bias whole."""

    partition = "input"

    def __init__(self, module: RowParallelLinear, tensor_parallel_factors: TensorParallelFactors = "exact") -> None:
        if not module.input_is_parallel:
            _refuse(module, "input_is_parallel=False")
        super().__init__(module, tensor_parallel_factors)


register_adapter(ColumnParallelLinear, ColumnParallelAdapter)
register_adapter(RowParallelLinear, RowParallelAdapter)


class MegatronMPU:
    """``megatron.core.parallel_state`` as DeepSpeed's engine reads an ``mpu``: everything delegated, plus the
    model-parallel (tensor x pipeline) rank and size that DeepSpeed asks for and ``parallel_state`` lacks."""

    def __init__(self, parallel_state: ModuleType) -> None:
        self._state = parallel_state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._state.get_model_parallel_group())

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._state.get_model_parallel_group())
