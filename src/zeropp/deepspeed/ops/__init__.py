"""``deepspeed.ops``: the optimizers integrations build themselves (``ops.adam.DeepSpeedCPUAdam`` as zeropp's
CPU Adam). DeepSpeed's other ops are not provided: importing one raises :class:`DeepSpeedAPIError`."""
