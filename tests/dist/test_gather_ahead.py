"""Note [gathers ahead of the forward] in ``zero/gather_ahead.py``: the optimizer step updates the units the last
forward began with first and starts their next-forward gathers while it updates the rest.

On 2 nodes x 2 ranks with ZeRO++ (qwZ + hpZ + qgZ), bf16: losses, weights and each step's bytes are bit-identical
to the engine that starts every gather in the forward; a write to the weights between the step and the next forward
(``GatheredParameters`` with a modifier, a state-dict load) is what that forward computes with; an optimizer that is
not known to update each parameter alone gets no gathers ahead; ``close()`` completes the ones no forward used.
"""
from __future__ import annotations

import torch

import zeropp
from support.world import run_world
from zeropp.demo.model import GPT, GPTConfig
from zeropp.zero.gather_ahead import GatherAhead

ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}


def _engine(seed: int, optimizer=None):  # noqa: ANN001, ANN202 - a torch optimizer factory or None
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, **ZEROPP}, "topology": {"ranks_per_node": 2}}
    if optimizer is None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    return zeropp.initialize(model=model, config=config, optimizer=optimizer)[0]


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))


def _train(rank: int, world: int, ahead: bool, write: str = "") -> dict:
    head = GatherAhead.head
    if not ahead:
        GatherAhead.head = staticmethod(lambda *a, **k: [])  # type: ignore[method-assign]
    try:
        engine = _engine(0)
        other = _engine(7).consolidated_state_dict() if write == "load" else None
        losses, comm, inflight = [], [], []
        for step in range(4):
            x = _batch(step, rank)
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            comm.append(engine.comm_report())
            inflight.append(sorted(u.index for u in engine._inflight))
            if step == 1 and write == "modify":  # rank 1's values become the weights everywhere
                first = next(engine.module.parameters())
                with zeropp.zero.GatheredParameters([first], modifier_rank=1):
                    if rank == 1:
                        first.data.mul_(0.5).add_(0.25)
            elif step == 1 and write == "load":
                engine.load_consolidated_state_dict(other)
        state = engine.consolidated_state_dict()
        engine.close()
        return {"losses": losses, "comm": comm, "inflight": inflight, "state": state,
                "after_close": len(engine._inflight)}
    finally:
        GatherAhead.head = head  # type: ignore[method-assign]


def _same_run(a: dict, b: dict, rewritten: int = -1) -> None:
    assert a["losses"] == b["losses"]
    for step, (x, y) in enumerate(zip(a["comm"], b["comm"])):  # the bytes started in a step count in the next
        if step == rewritten:  # the gathers started before the write were completed, dropped and made again
            assert x["forward_gather"]["inter_node_bytes"] > y["forward_gather"]["inter_node_bytes"]
            x, y = ({k: v for k, v in c.items() if k != "forward_gather"} for c in (x, y))
        assert x == y, step
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def test_gathers_ahead_change_no_value_and_no_step_bytes() -> None:
    on = run_world(_train, 4, True, ranks_per_node=2)
    off = run_world(_train, 4, False, ranks_per_node=2)
    for a, b in zip(on, off):
        _same_run(a, b)
        assert a["inflight"] == [[0, 1]] * 4  # the first unit whole and the second's first hop
        assert b["inflight"] == [[]] * 4
        assert a["after_close"] == 0


def test_a_write_before_the_forward_is_what_the_forward_computes_with() -> None:
    for write in ("modify", "load"):
        on = run_world(_train, 4, True, write, ranks_per_node=2)
        off = run_world(_train, 4, False, write, ranks_per_node=2)
        plain = run_world(_train, 4, False, ranks_per_node=2)
        for a, b, c in zip(on, off, plain):
            _same_run(a, b, rewritten=2)
            assert a["losses"][2] != c["losses"][2], write  # the write changed what step 2 computed


def _adagrad_run(rank: int, world: int) -> dict:
    engine = _engine(0, optimizer=lambda params: torch.optim.Adagrad(params, lr=1e-2))
    x = _batch(0, rank)
    engine.backward(engine(x, x))
    engine.step()
    return {"inflight": len(engine._inflight), "optimizer": type(engine.optimizer).__name__}


def test_an_optimizer_not_known_to_update_each_parameter_alone_gets_no_gathers_ahead() -> None:
    for r in run_world(_adagrad_run, 4, ranks_per_node=2):
        assert r == {"inflight": 0, "optimizer": "Adagrad"}
