"""``--calibrate``: K-FAC's compute and the collectives' latency and bandwidth, measured on the launched ranks.

Run under the user's launcher (``deepspeed --num_gpus N -m ds_kfac.plan --calibrate ...``), so that what is timed
is their device and their network. Two measurements, every rank at once (each on its own device, as in training):

* :func:`measure_phases`: the real :class:`~ds_kfac.KFACPreconditioner` with the job's ``"kfac"`` section on the
  job's model, every layer on this rank alone (a process group of one), for a warm-up refresh cycle and then a
  timed one: K-FAC's seconds per step by phase (:data:`ds_kfac.timing.PHASES`), and the forward and backward's;
* :func:`measure_links`: K-FAC's own collectives (:mod:`ds_kfac.comm`, so a simulated network,
  :mod:`ds_kfac.comm.network`, is measured too: all-reduce, broadcast and ZeRO 3's all-to-all) across every launched
  rank, at payloads from 4 KiB to 16 MiB: a least-squares latency and per-byte time per kind.

The slowest rank's figures are kept (a step waits for it). :mod:`.predict` turns them into seconds per placement.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_reduce_sum_, all_to_all_, broadcast_, data_parallel_world
from ..config import KFACConfig
from ..optimizers import Adam, split_groups
from ..preconditioner import KFACPreconditioner
from ..preconditioning.build import preconditioned_parameters
from ..timing import PHASES
from .job import placed
from .predict import Calibration, Link, collected, layer_shapes

Batch = dict[str, torch.Tensor]
LINK_BYTES = tuple(4096 * 4**i for i in range(7))
"""The payloads the links are timed at: 4 KiB to 16 MiB."""


def _slowest(values: Sequence[float], group: Optional[dist.ProcessGroup]) -> list[float]:
    """Each value's maximum over ``group``'s ranks."""
    tensor = torch.tensor(list(values), dtype=torch.float64)
    if data_parallel_world(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _alone() -> Optional[dist.ProcessGroup]:
    """A process group of this rank alone (every rank creates every one-rank group, as ``new_group`` requires)."""
    if not dist.is_initialized():
        return None
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r])
        mine = group if r == dist.get_rank() else mine
    return mine


@dataclass(frozen=True)
class Timed:
    """What ``--calibrate`` times: ``model`` with the job's ``"kfac"`` ``section``, ``accumulation`` micro-batches a
    step, cycling through ``batches``, each's ``loss``."""

    model: nn.Module
    section: dict[str, Any]
    batches: Sequence[Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    accumulation: int


def measure_phases(timed: Timed, steps: Optional[int] = None) -> tuple[dict[str, float], float, dict[str, int]]:
    """K-FAC's seconds per step by phase and the forward and backward's, the model preconditioned alone on this
    rank: one refresh cycle of warm-up (the first full decompositions), then ``steps`` (default: one cycle) timed.
    Returns the cadence measured at too."""
    model, accumulation = timed.model, timed.accumulation
    config = placed(timed.section, "comm-opt")
    cycle = config.inv_update_steps if isinstance(config.inv_update_steps, int) else 4 * config.factor_update_steps
    params = model.parameters()
    if config.eigenbasis_moments:
        params = split_groups(params, preconditioned_parameters(model, config))
    optimizer = Adam(params)  # the eigenbasis moments' rule; never stepped: the weights stay
    micro = [0]
    kfac = KFACPreconditioner(
        model, config, optimizer=optimizer, accumulation_steps=accumulation, micro_batch=lambda: micro[0],
        process_group=_alone(),
    )  # fmt: skip
    device = next(model.parameters()).device
    kfac.timer.synchronize = device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    phases: dict[str, float] = {}
    total, counted, at = 0.0, steps or cycle, 0
    for step in range(cycle + counted):
        kfac.timings.clear()
        sync()
        start = time.perf_counter()
        for micro[0] in range(accumulation):
            timed.loss(model, timed.batches[at % len(timed.batches)]).div(accumulation).backward()
            at += 1
        kfac.step()
        sync()
        model.zero_grad(set_to_none=True)
        if step >= cycle:
            total += time.perf_counter() - start
            for phase, seconds in kfac.timings.items():
                phases[phase] = phases.get(phase, 0.0) + seconds
    cadence = {"factor_update_steps": config.factor_update_steps, "inv_update_steps": cycle}
    return {p: s / counted for p, s in phases.items()}, (total - sum(phases.values())) / counted, cadence


def measure_links(
    device: torch.device, group: Optional[dist.ProcessGroup] = None, repeats: int = 5, sizes: Sequence[int] = LINK_BYTES
) -> tuple[dict[str, Link], dict[str, list[list[float]]]]:
    """Each collective kind's latency and per-byte time across ``group``'s ranks (least squares over ``sizes``, the
    median of ``repeats`` timings each, the slowest rank's), and the timings."""
    world = data_parallel_world(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    kinds: dict[str, Callable[[torch.Tensor], None]] = {
        "all_reduce": lambda t: all_reduce_sum_([t], group),
        "broadcast": lambda t: broadcast_([t], [root], [group]),
        "all_to_all": lambda t: _exchange(t, group, world),
    }
    links, samples = {}, {}
    for kind, run in kinds.items():
        medians = []
        sent = [n * (world - 1) // world if kind == "all_to_all" and world > 1 else n for n in sizes]  # to others
        for nbytes in sizes:
            tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            seconds = []
            for _ in range(repeats + 1):  # the first, uncounted
                if world > 1:
                    dist.barrier(group)
                start = time.perf_counter()
                run(tensor)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - start)
            medians.append(statistics.median(seconds[1:]))
        medians = _slowest(medians, group)
        samples[kind] = [[float(n), s] for n, s in zip(sent, medians)]
        links[kind] = _fit(sent, medians)
    return links, samples


def _exchange(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], world: int) -> None:
    """One all-to-all of ``tensor``, an equal share of it to each rank (ZeRO 3's gradients' slices)."""
    share = tensor.numel() // world
    send = [[tensor[r * share : (r + 1) * share]] for r in range(world)]
    recv = [[torch.empty_like(part) for part in pieces] for pieces in send]
    all_to_all_(send, recv, group, tensor.dtype, tensor.device)


def _fit(sizes: Sequence[int], seconds: Sequence[float]) -> Link:
    """The least-squares line ``seconds = latency + per_byte * bytes`` (each clipped at 0)."""
    x = torch.tensor([[1.0, float(n)] for n in sizes], dtype=torch.float64)
    y = torch.tensor(list(seconds), dtype=torch.float64)
    scale = torch.tensor([1.0, float(max(sizes))], dtype=torch.float64)  # conditioning
    coef = torch.linalg.lstsq(x / scale, y.unsqueeze(1)).solution.squeeze(1) / scale
    return Link(max(float(coef[0]), 0.0), max(float(coef[1]), 0.0))


def calibrate(timed: Timed, steps: Optional[int] = None, group: Optional[dist.ProcessGroup] = None) -> Calibration:
    """Both measurements on every launched rank (collective: every rank of ``group`` calls it), the slowest rank's
    figures."""
    device = next(timed.model.parameters()).device
    phases, forward_backward, cadence = measure_phases(timed, steps)
    slowest = _slowest([phases.get(n, 0.0) for n in PHASES] + [forward_backward], group)
    links, samples = measure_links(device, group)
    accumulation, config = timed.accumulation, KFACConfig.parse(timed.section)
    return Calibration(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        world=data_parallel_world(group),
        phases=dict(zip(PHASES, slowest[:-1])),
        forward_backward=slowest[-1],
        accumulation=accumulation,
        micro_batch=len(next(iter(timed.batches[0].values()))),
        collected=collected(config, accumulation),
        cadence=cadence,
        links=links,
        samples=samples,
        layers=layer_shapes(timed.model, config),
    )
