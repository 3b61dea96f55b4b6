"""Communication: bucketed collectives on flat buffers, with byte counts."""

from .collectives import DEFAULT_BUCKET_BYTES, STATS, all_reduce_mean_, all_reduce_sum_, buckets, data_parallel_world

__all__ = ["DEFAULT_BUCKET_BYTES", "STATS", "all_reduce_mean_", "all_reduce_sum_", "buckets", "data_parallel_world"]
