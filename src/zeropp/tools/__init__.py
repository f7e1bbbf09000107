"""The user-facing commands, apart from the library: the ``zeropp`` command line (``cli.py``), the training
job it runs (``job.py``, on ``demo/``'s model and data), the planner (``plan/``) and the emulated-cluster
benchmark (``cluster_bench/``). Nothing in the library imports this package."""
