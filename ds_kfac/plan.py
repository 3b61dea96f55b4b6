"""``python -m ds_kfac.plan``: the K-FAC memory and traffic planner (:mod:`ds_kfac.planning`)."""

from .planning.cli import main

if __name__ == "__main__":
    main()
