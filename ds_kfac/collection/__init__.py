"""Collection: the module hooks that gather each layer's factors during forward and backward."""

from .collector import FactorCollector, LossScale, compile_reason

__all__ = ["FactorCollector", "LossScale", "compile_reason"]
