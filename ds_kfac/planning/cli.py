"""``python -m ds_kfac.plan``: each rank's K-FAC memory and traffic for every placement, before launch.

Example (docs/placement.md, "Planning before launch")::

    python -m ds_kfac.plan --deepspeed_config configs/bert_large_phase1_kfac.json --model bert-large --world 64
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Union

from ..config import KFACConfigError
from ..placement import workers_per_layer
from .job import read_job
from .models import PRESETS, bert_config, bert_on_meta
from .placements import FRACTIONS, REDUCTIONS, plan_job
from .report import render


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
    parser.add_argument("--world", type=int, required=True, help="data-parallel ranks")
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
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    try:
        job = read_job(args.deepspeed_config, args.world)
        for asked in args.fraction or ():  # an asked fraction that does not fit is an error, not a refused row
            job.config_for(asked, job.kfac.factor_reduction)
            workers_per_layer(asked, args.world)
        spec = args.model or job.bert.get("model")
        if spec is None:
            raise ValueError("--model is required: the config has no bert.model")
        keys = bert_config(spec, job.bert, args.vocab_size)
        model, groups = bert_on_meta(keys)
        plan = plan_job(model, job, args.fraction or FRACTIONS, args.reduction or REDUCTIONS, groups)
    except (KFACConfigError, ValueError) as err:
        raise SystemExit(f"python -m ds_kfac.plan: {err}") from None
    title = f"BertForPreTraining {keys['num_hidden_layers']}x{keys['hidden_size']} (vocab {keys['vocab_size']})"
    print(render(plan, title, args.per_rank))
