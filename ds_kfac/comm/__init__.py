"""Communication: bucketed collectives on flat buffers, with byte counts, and the plan's process groups."""

from .collectives import (
    DEFAULT_BUCKET_BYTES,
    STATS,
    all_reduce_mean_,
    all_reduce_sum_,
    broadcast_,
    buckets,
    data_parallel_world,
    pack_symmetric,
    reduce_mean_to_,
    unpack_symmetric,
)
from .groups import RankGroups

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "STATS",
    "RankGroups",
    "all_reduce_mean_",
    "all_reduce_sum_",
    "broadcast_",
    "buckets",
    "data_parallel_world",
    "pack_symmetric",
    "reduce_mean_to_",
    "unpack_symmetric",
]
