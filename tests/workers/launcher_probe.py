"""A rank that reports how the launcher started it, for tests of the benchmarks' real-launcher path.

Run with the arguments ``time_to_target.launch`` gives an example (``--deepspeed_config``, ``--seed``,
``--output-dir``, ``--run-name`` and the run's extra ones; the ``deepspeed`` launcher adds ``--local_rank``), it prints
a line and writes ``<output-dir>/<run-name>/rank<RANK>.json``: its arguments and the launcher's variables. With
``--exit N`` it exits with code ``N`` after that. Imports nothing heavy: the launcher's start is what is tested.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
for name in ("--deepspeed_config", "--output-dir", "--run-name"):
    parser.add_argument(name, required=True)
parser.add_argument("--seed", type=int, required=True)
parser.add_argument("--local_rank", type=int, required=True)
parser.add_argument("--exit", type=int, default=0)
args, extra = parser.parse_known_args()
variables = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
report = {"args": vars(args), "extra": extra, "env": {k: os.environ.get(k) for k in variables}}
out = Path(args.output_dir) / args.run_name
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} started", flush=True)
sys.exit(args.exit)
