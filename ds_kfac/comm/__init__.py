"""Communication: bucketed collectives on flat buffers (ordered ones to overlap backward), with byte counts,
and the plan's process groups."""

from .collectives import (
    DEFAULT_BUCKET_BYTES,
    STATS,
    all_reduce_sum_,
    all_to_all_,
    broadcast_,
    buckets,
    data_parallel_rank,
    data_parallel_world,
    gather_,
    pack_symmetric,
    receive,
    scatter_,
    send_,
    start_all_reduce_sum_,
    unpack_symmetric,
)
from .groups import RankGroups, create_groups
from .ordered import OrderedBuckets

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "STATS",
    "OrderedBuckets",
    "RankGroups",
    "all_reduce_sum_",
    "all_to_all_",
    "broadcast_",
    "buckets",
    "create_groups",
    "data_parallel_rank",
    "data_parallel_world",
    "gather_",
    "pack_symmetric",
    "receive",
    "scatter_",
    "send_",
    "start_all_reduce_sum_",
    "unpack_symmetric",
]
