"""``deepspeed.launcher``: what launchers built on DeepSpeed's import from it (``launcher/runner.py``)."""
