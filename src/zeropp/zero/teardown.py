"""``engine.destroy()``: give the model back as a plain model with its current weights whole.

Note [leaving the model whole]: ``initialize`` makes every parameter a view of a unit's padded buffer and puts
hooks on the model and its parameters (the units' gathers and releases, the gradient hooks, the watches of
Note [external reads] and the state-dict guards). A script that destroys an engine and initializes the same
model again (accelerate's ``free_memory()`` then a new ``prepare``, DeepSpeed's own tests) would otherwise
hand the second engine parameters with no storage (stage 3) and leave the first engine's gradient hooks
firing into its buckets. So ``leave_whole`` gathers every sharded unit from the fp32 masters (collective:
every rank calls it), gives each parameter a storage of its own holding its current value (in the compute
dtype, as the engine trained it), frees the units' buffers, removes every hook the engine put on the model
and forgets the engine, so that no zeropp name still reaches the parameters. A second ``initialize`` then
starts from those values as from a fresh model holding them.
"""
from __future__ import annotations

import torch

from zeropp.partition.unit import UnitState
from zeropp.zero import gathered
from zeropp.zero.state import EngineHandle


def leave_whole(engine: EngineHandle) -> None:
    """Note [leaving the model whole]: every parameter holds its current value in a storage of its own (the
    engine then removes its hooks and forgets the units). Collective."""
    engine.join_update()
    gathered.gather_from_masters(engine)  # sharded units, as GatheredParameters gathers them (collective)
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for unit in engine.state.units:
            assert unit.state is UnitState.GATHERED
            for slot in unit.slots:
                slot.param.data = slot.full[: slot.spec.numel].view(slot.spec.shape).clone()
            unit.release()  # the buffers only: the parameters own their storage now
