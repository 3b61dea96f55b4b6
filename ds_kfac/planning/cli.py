"""``python -m ds_kfac.plan``: each rank's K-FAC memory and traffic for every placement, before launch.

Examples (docs/placement.md, "Planning before launch" and "Time: calibrate")::

    python -m ds_kfac.plan --deepspeed_config configs/bert_large_phase1_kfac.json --model bert-large --world 64
    deepspeed --num_gpus 8 -m ds_kfac.plan --calibrate --save-calibration cal.json \
        --deepspeed_config configs/bert_large_phase1_kfac.json --model bert-large
    python -m ds_kfac.plan --calibration cal.json --deepspeed_config ... --model bert-large --world 256
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..comm.network import Network
from ..config import KFACConfigError
from ..placement import workers_per_layer
from ..placement.plan import zero3_problem
from .calibrate import Timed, calibrate
from .job import read_job
from .models import BERT_DEFAULTS, PRESETS, bert_batches, bert_config, bert_on, bert_on_meta
from .placements import FRACTIONS, REDUCTIONS, plan_job
from .predict import Calibration, predict_plan
from .report import render, render_times


def fraction(value: str) -> Union[str, float]:
    """A ``grad_worker_fraction``: a preset name or a number."""
    try:
        return float(value)
    except ValueError:
        return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ds_kfac.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help='the DeepSpeed JSON, with its "kfac" section')
    parser.add_argument(
        "--model",
        help=f"a preset ({', '.join(PRESETS)}) or a transformers.BertConfig JSON file; default: the config's "
        f"bert.model, as examples/bert/pretrain.py reads it",
    )
    parser.add_argument(
        "--world", type=int, help="data-parallel ranks (default: the launched ranks, under --calibrate)"
    )
    parser.add_argument("--vocab-size", type=int, help="the vocabulary (default: the preset's, else bert.vocab_size)")
    parser.add_argument(
        "--fraction",
        type=fraction,
        action="append",
        help=f"a grad_worker_fraction to plan (repeatable; default: {', '.join(FRACTIONS)})",
    )
    parser.add_argument(
        "--reduction", choices=REDUCTIONS, action="append", help="a factor_reduction to plan (default: all)"
    )
    parser.add_argument("--per-rank", action="store_true", help="every rank's line, not the largest and smallest")
    timing = parser.add_argument_group("time (docs/placement.md, 'Time: calibrate')")
    timing.add_argument(
        "--calibrate",
        action="store_true",
        help="under the launcher: time K-FAC's phases on this device and the collectives across the launched ranks, "
        "then predict each placement's seconds per step and recommend one",
    )
    timing.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    timing.add_argument("--calibrate-steps", type=int, help="timed steps (default: one refresh cycle)")
    timing.add_argument("--save-calibration", type=Path, help="write the calibration (JSON) here (rank 0)")
    timing.add_argument("--calibration", type=Path, help="predict from a saved calibration, without launching")
    timing.add_argument(
        "--network",
        metavar="latency=S,bandwidth=B",
        help="predict the collectives on this network (seconds a message, bytes a second a GPU) instead of the "
        "calibration's measured links: a cluster's interconnect between nodes, for a world not launched",
    )
    timing.add_argument(
        "--refresh-budget",
        type=float,
        default=0.05,
        help="the recommended refresh interval is the shortest whose decompositions cost at most this fraction of "
        "the forward and backward (default 0.05)",
    )
    args = parser.parse_args(argv)
    if args.calibrate and args.calibration:
        parser.error("--calibrate measures a calibration; --calibration reads one: give one of them")
    if args.world is None and not args.calibrate:
        parser.error("--world is required (or run under the launcher with --calibrate)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    if args.calibrate:
        calibration, rank = _calibrate(args)
        args.world = args.world or calibration.world
        if rank != 0:
            return
    try:
        job = read_job(args.deepspeed_config, args.world)
        for asked in args.fraction or ():  # an asked fraction that does not fit is an error, not a refused row
            job.config_for(asked, job.kfac.factor_reduction)
            workers_per_layer(asked, args.world)
            if job.zero_stage == 3 and zero3_problem(asked, args.world):
                raise KFACConfigError(zero3_problem(asked, args.world))
        spec = args.model or job.bert.get("model")
        if spec is None:
            raise ValueError("--model is required: the config has no bert.model")
        keys = bert_config(spec, job.bert, args.vocab_size)
        model, groups = bert_on_meta(keys)
        plan = plan_job(model, job, args.fraction or FRACTIONS, args.reduction or REDUCTIONS, groups)
        if calibration is None and job.kfac.calibration is not None:  # "auto": what it will choose from
            calibration = Calibration.load(job.kfac.calibration)
    except (KFACConfigError, ValueError, OSError) as err:
        raise SystemExit(f"python -m ds_kfac.plan: {err}") from None
    title = f"BertForPreTraining {keys['num_hidden_layers']}x{keys['hidden_size']} (vocab {keys['vocab_size']})"
    print(render(plan, title, args.per_rank))
    if calibration is not None:
        if args.network:
            try:
                Network.parse(args.network)
            except ValueError as err:
                raise SystemExit(f"python -m ds_kfac.plan --network: {err}") from None
            calibration.network = args.network
        print()
        print(render_times(plan, predict_plan(plan, calibration), calibration, args.refresh_budget))
        if job.kfac.calibration is not None and not (args.calibration or args.calibrate or args.fraction):
            print(f"(kfac.grad_worker_fraction 'auto' chooses this fraction at start-up, from {job.kfac.calibration})")


def _calibrate(args: argparse.Namespace) -> tuple[Calibration, int]:
    """The calibration, measured on the launched ranks (each on its own device, as in training; rank 0 saves it),
    and this process's rank. Every rank leaves the process group before rank 0 plans."""
    from ..integration.cleanup import shutdown
    from ..integration.extensions import init_distributed  # the launcher's environment, as training

    init_distributed()
    rank = dist.get_rank()
    try:
        world = dist.get_world_size()
        job = read_job(args.deepspeed_config, world)
        spec = args.model or job.bert.get("model")
        if spec is None:
            raise ValueError("--model is required: the config has no bert.model")
        keys = bert_config(spec, job.bert, args.vocab_size)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
        model = bert_on(keys, device or torch.device("cpu"))
        seq = {**BERT_DEFAULTS, **job.bert}["max_seq_length"]
        batches = bert_batches(keys, job.micro_batch, seq, device or torch.device("cpu"))
        timed = Timed(model, job.section, batches, lambda m, b: m(**b).loss, job.accumulation)
        calibration = calibrate(timed, args.calibrate_steps)
        if rank == 0 and args.save_calibration:
            calibration.save(args.save_calibration)
        return calibration, rank
    except (KFACConfigError, ValueError) as err:
        raise SystemExit(f"python -m ds_kfac.plan --calibrate: {err}") from None
    finally:
        shutdown()
