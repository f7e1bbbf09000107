"""The watches' redispatch (Note [watches stay on] in ``zero/idle_watch.py``): a mode that calls through
``run_watched`` sees the torch calls made inside a backward, on this torch and on one without
``torch.overrides.redispatch_function`` (before 2.13, Note [torch without one-hop skip])."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from zeropp.zero import idle_watch


class _Seen(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.calls.append(getattr(func, "__name__", str(func)))
        return idle_watch.run_watched(self, func, types, args, kwargs or {})


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w).sum(-1)


@pytest.mark.parametrize("torch_has_skip", [True, False])
@pytest.mark.parametrize("how", ["tensor_backward", "autograd_backward"])
def test_calls_inside_a_backward_are_seen(monkeypatch: pytest.MonkeyPatch, torch_has_skip: bool, how: str) -> None:
    if not torch_has_skip:
        monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    loss = checkpoint(_block, x, w, use_reentrant=False).sum()
    ref = torch.autograd.grad(_block(x, w).sum(), w)[0]
    with _Seen() as mode:
        if how == "tensor_backward":
            loss.backward()
        else:
            torch.autograd.backward([loss], inputs=[w])
    # the recomputed forward's matmul and tanh ran inside the backward, and the watch saw them
    assert "tanh" in mode.calls and "matmul" in mode.calls, mode.calls
    torch.testing.assert_close(w.grad, ref)


def test_a_python_bodied_function_still_runs_without_the_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.overrides, "redispatch_function", raising=False)
    x = torch.randn(2, 8)
    with _Seen() as mode:
        out = torch.nn.functional.layer_norm(x, (8,))
    assert "layer_norm" in mode.calls
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,)))
