"""The planner's launch: one 4-rank job that is also two 2-rank jobs and four 1-rank jobs, one after the other.

``--spec`` is a JSON object: ``"4"``, the scenarios (``ds_worker``'s keys) the 4 ranks run together; ``"2"``, two
lists, those the ranks ``{0, 1}`` and ``{2, 3}`` run as two 2-rank jobs; ``"1"``, four lists, those each rank runs
alone; ``"ports"``, a port for each 2-rank job and each 1-rank job (``"2"``, ``"1"``), on which the test serves the
job's store from before the launch (``launch.held_port``; no rank binds it, so no gloo connection of an earlier phase
can take it first). Between the phases each rank shuts its process group down (``ds_kfac.shutdown()``) and joins the
next one on its port: one launcher start-up for three world sizes. Each result is ``ds_worker.train``'s, saved to
``<out>/w<world>_<job>_<index>_rank<rank>.pt`` (``<rank>`` within its job).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ds_worker  # noqa: E402

import ds_kfac  # noqa: E402


def main() -> None:
    args = ds_worker.launched()
    spec, out = json.loads(Path(args.spec).read_text()), Path(args.out)
    rank = dist.get_rank()
    for i, scenario in enumerate(spec["4"]):
        torch.save(ds_worker.run(scenario), out / f"w4_0_{i}_rank{rank}.pt")
    for size in (2, 1):
        ds_kfac.shutdown()
        job, local = divmod(rank, size)
        port = spec["ports"][str(size)][job]
        os.environ.update(RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(size), MASTER_PORT=str(port))
        os.environ.update(LOCAL_SIZE=str(size))
        ds_kfac.init_distributed()
        for i, scenario in enumerate(spec[str(size)][job]):
            torch.save(ds_worker.run(scenario), out / f"w{size}_{job}_{i}_rank{local}.pt")
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
