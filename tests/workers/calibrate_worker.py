"""``python -m ds_kfac.plan`` as one launched rank runs it (``deepspeed --module ds_kfac.plan ...``): its arguments,
the launcher's ``--local_rank`` among them. The test forks it preloaded (``launch.deepspeed_script``), which cannot
start a module by name."""

import sys

from ds_kfac.planning.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
