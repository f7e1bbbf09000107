"""Activation memory: recomputation (``checkpointing.py``: what a checkpointed region saves, where its inputs
wait, how they are split over a node) and the node split of saved inputs (``split.py``)."""
