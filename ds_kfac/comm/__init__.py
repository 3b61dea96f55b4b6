"""Communication: bucketed collectives on flat buffers."""

from .collectives import DEFAULT_BUCKET_BYTES, all_reduce_mean_, buckets, data_parallel_world

__all__ = ["DEFAULT_BUCKET_BYTES", "all_reduce_mean_", "buckets", "data_parallel_world"]
