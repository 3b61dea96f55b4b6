"""A simulated interconnect: each K-FAC collective held back by what it would take on a stated network.

Set ``DS_KFAC_SIMULATED_NETWORK="latency=<seconds>,bandwidth=<bytes per second>"`` in every rank's environment (the
``deepspeed`` launcher passes the environment on) and, after each of K-FAC's collectives completes, the rank sleeps
for that collective's time on a network with that per-message latency ``alpha`` and per-link bandwidth ``B``, by the
textbook cost of the algorithm NCCL and gloo use for it at ``p`` ranks and ``n`` payload bytes:

* all-reduce: the faster of a ring, ``2 (p - 1) alpha + 2 (p - 1) / p * n / B``, and a tree (a reduce then a
  broadcast, pipelined), ``2 ceil(log2 p) alpha + 2 n / B``, as NCCL picks by size and scale;
* reduce and broadcast (binomial tree, pipelined): ``ceil(log2 p) alpha + n / B``;
* all-to-all and point to point: ``(p - 1) alpha + n / B`` (``n``: the bytes this rank sends).

The delay comes on top of the real transfer (on one machine, shared memory: far faster than any network), so runs at
2 to 8 ranks on this machine show how K-FAC's overheads, and ``python -m ds_kfac.plan --calibrate``'s recommendation,
move with the network (docs/placement.md, "A network that is not this machine's"). Collectives overlapped with the
backward pass are delayed when they are waited for, so the simulation does not credit overlap. Without the variable
nothing is delayed. Only K-FAC's collectives are slowed, not DeepSpeed's gradient all-reduce.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

ENV = "DS_KFAC_SIMULATED_NETWORK"


@dataclass(frozen=True)
class Network:
    """A network by its per-message latency (seconds) and per-link bandwidth (bytes per second)."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and self.bandwidth > 0 and math.isfinite(self.latency)):
            raise ValueError(f"{ENV}: latency must be >= 0 and bandwidth > 0 (got {self.latency}, {self.bandwidth})")

    def seconds(self, kind: str, nbytes: int, world: int) -> float:
        """The time of one ``kind`` collective of ``nbytes`` payload among ``world`` ranks (0 alone)."""
        if world <= 1:
            return 0.0
        hops = math.ceil(math.log2(world))
        if kind == "all_reduce":
            ring = 2 * (world - 1) * (self.latency + nbytes / (world * self.bandwidth))
            return min(ring, 2 * (hops * self.latency + nbytes / self.bandwidth))
        if kind in ("reduce", "broadcast"):
            return hops * self.latency + nbytes / self.bandwidth
        return (world - 1) * self.latency + nbytes / self.bandwidth

    @classmethod
    def parse(cls, text: str) -> Network:
        """``"latency=5e-6,bandwidth=25e9"`` (seconds, bytes per second; both required)."""
        fields = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("latency", "bandwidth"):
                raise ValueError(f"{ENV}={text!r}: expected 'latency=<seconds>,bandwidth=<bytes per second>'")
            try:
                fields[key.strip()] = float(value)
            except ValueError:
                raise ValueError(f"{ENV}={text!r}: {key.strip()} is not a number") from None
        if set(fields) != {"latency", "bandwidth"}:
            raise ValueError(f"{ENV}={text!r}: both latency and bandwidth are required")
        return cls(fields["latency"], fields["bandwidth"])


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> Optional[Network]:
    return Network.parse(text) if text.strip() else None


def simulated() -> Optional[Network]:
    """The simulated network the environment asks for now, or ``None`` (read at each collective, so a process
    forked before the variable was set sees it too; parsed once per value)."""
    return _parsed(os.environ.get(ENV, ""))


def hold(kind: str, nbytes: int, world: int) -> None:
    """Sleep for one completed collective's simulated time (nothing without a simulated network)."""
    network = simulated()
    if network is not None:
        time.sleep(network.seconds(kind, nbytes, world))
