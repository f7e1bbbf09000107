"""CpuAdam against torch.optim.AdamW / Adam (foreach=False): bit for bit when the kernel's self-test says it
is exact (Note [bit-exact with torch] in zeropp/offload/cpu_adam.py), else within 2 ulp; the torch fallback;
the fused 16-bit copy; state-dict interchange with torch; errors."""

from __future__ import annotations

import pytest
import torch

from zeropp.offload import CpuAdam, kernel_info
from zeropp.offload.cpu_adam import _ulp_diff

SIZES = (1, 7, 8, 33, 1000, 2048 * 3 + 5, 70_001, 0)


def _params(sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _grads(sizes, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes over several decades, a zero gradient, and an exactly-zero block (v stays 0: sqrt(0) path)
    out = []
    for k in range(steps):
        gs = [torch.randn(n, generator=gen) * 10.0 ** float(k % 5 - 3) for n in sizes]
        for g in gs:
            g[: min(3, g.numel())] = 0.0
        out.append(gs)
    return out


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    if kernel_info().exact:
        assert torch.equal(a, b), f"max ulp {_ulp_diff(a, b)}"
    else:  # a build whose sqrt cannot reproduce torch's: the documented bound
        assert _ulp_diff(a, b) <= 2 * 10


def _run_pair(make_ours, make_ref, sizes=SIZES, steps=10, out16=None):
    ours, ref = _params(sizes), _params(sizes)
    o, r = make_ours(ours), make_ref(ref)
    copies = {p: torch.empty(p.shape, dtype=out16) for p in ours} if out16 else None
    for gs in _grads(sizes, steps):
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        o.step(out16=copies) if copies else o.step()
        r.step()
    return ours, ref, o, r, copies


def test_kernel_available_and_exact_here():
    info = kernel_info()
    assert info.available, info.reason
    assert info.exact  # this machine: MKL torch build on x86-64 with AVX2/FMA (see docs/benchmarks.md)


@pytest.mark.parametrize("adamw,betas,wd", [
    (True, (0.9, 0.999), 0.01),    # AdamW, lerp weight 0.1 (< 0.5 branch)
    (True, (0.3, 0.95), 0.1),      # lerp weight 0.7 (>= 0.5 branch)
    (True, (0.9, 0.999), 0.0),     # no decay: torch skips the multiply
    (False, (0.9, 0.99), 0.05),    # Adam with L2 decay: grad + wd * p (an FMA in ATen)
])
def test_matches_torch_10_steps(adamw, betas, wd):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ours, ref, o, r, _ = _run_pair(
        lambda ps: CpuAdam(ps, lr=3e-3, betas=betas, eps=1e-8, weight_decay=wd, adamw=adamw),
        lambda ps: torch_cls(ps, lr=3e-3, betas=betas, eps=1e-8, weight_decay=wd, foreach=False))
    for p, q in zip(ours, ref):
        _assert_close(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close(o.state[p][key], r.state[q][key])
        assert torch.equal(o.state[p]["step"], r.state[q]["step"])


def test_two_threads_and_many_tensors_cross_part_boundaries():
    sizes = (300_001, *(range(1, 200)), 65_537)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, ref, *_ = _run_pair(lambda ps: CpuAdam(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
                                  sizes=sizes, steps=3)
    finally:
        torch.set_num_threads(prev)
    for p, q in zip(ours, ref):
        _assert_close(p, q)


def test_param_groups_with_different_hyperparameters():
    def groups(ps):
        return [{"params": ps[:3], "lr": 1e-2, "weight_decay": 0.1},
                {"params": ps[3:], "betas": (0.8, 0.9), "eps": 1e-6}]
    ours, ref, *_ = _run_pair(lambda ps: CpuAdam(groups(ps), lr=1e-3),
                              lambda ps: torch.optim.AdamW(groups(ps), lr=1e-3, weight_decay=0.0, foreach=False),
                              steps=4)
    for p, q in zip(ours, ref):
        _assert_close(p, q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_16bit_copy(dtype):
    ours, _, o, _, copies = _run_pair(lambda ps: CpuAdam(ps, weight_decay=0.01),
                                      lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, foreach=False),
                                      steps=3, out16=dtype)
    for p in ours:
        assert torch.equal(copies[p], p.to(dtype))
    # step_and_copy is the same call; a copy can be any shape with the same number of elements
    p = ours[4]
    p.grad = torch.ones_like(p)
    shard16 = torch.empty(10, 100, dtype=dtype)
    o.step_and_copy({p: shard16})
    assert torch.equal(shard16.view(-1), p.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_16bit_copy_of_special_values_equals_torchs_cast(dtype):
    """Denormals, infinities, rounding ties and values beyond fp16's range equal torch's cast bit for bit (the
    fast bf16 conversion instruction reads denormals as zero, so their vectors take another path). NaNs of
    either sign stay NaNs; their bit pattern is not compared (torch's own cast writes 0xFFFF or 0x7FC0
    depending on whether the lane is in a vector or in the scalar tail)."""
    bits = torch.tensor([0x00000001, 0x007FFFFF, 0x80400000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000,
                         0xFF800000, 0x3F808000, 0x3F818000, 0x477FF000, 0x00000000, 0x80000000, 0x3F800001],
                        dtype=torch.int64).to(torch.int32)
    rng = torch.Generator().manual_seed(3)
    values = torch.cat([bits.view(torch.float32), torch.randn(4096, generator=rng) * 1e-38,
                        torch.randn(4096, generator=rng) * 7e4])
    values = values[torch.randperm(values.numel(), generator=rng)]  # special lanes spread over the vectors
    p = torch.nn.Parameter(values.clone())
    p.grad = torch.zeros_like(p)
    out = torch.empty(p.numel(), dtype=dtype)
    CpuAdam([p], lr=0.0, weight_decay=0.0).step_and_copy({p: out})
    expect = p.detach().to(dtype)
    nan = expect.isnan()
    assert nan.sum() == 3 and torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expect.view(torch.int16)[~nan])


def test_torch_fallback_path_is_the_reference():
    ours, ref, *_ = _run_pair(lambda ps: _forced(CpuAdam(ps, weight_decay=0.01), "torch"),
                              lambda ps: torch.optim.AdamW(ps, weight_decay=0.01, foreach=False), steps=3)
    for p, q in zip(ours, ref):
        assert torch.equal(p, q)


def _forced(opt: CpuAdam, path: str) -> CpuAdam:
    opt._force = path
    return opt


def test_non_contiguous_and_gradless_params_mixed_with_kernel_params():
    base = torch.randn(64, 33)
    ours = [base.clone().t(), torch.randn(1000), torch.randn(5)]  # transposed: not contiguous -> torch path
    ref = [t.clone() for t in ours]
    o = CpuAdam(ours, weight_decay=0.01)
    r = torch.optim.AdamW(ref, weight_decay=0.01, foreach=False)
    for k in range(3):
        for i, (p, q) in enumerate(zip(ours, ref)):
            if i == 2:
                continue  # never has a gradient: skipped, no state
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        o.step()
        r.step()
    for p, q in zip(ours, ref):
        _assert_close(p, q)
    assert ours[2] not in o.state


def test_state_dict_interchange_with_torch():
    sizes = (10, 1000)
    a, b = _params(sizes), _params(sizes)
    ours = CpuAdam(a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    grads = _grads(sizes, 6)
    for gs in grads[:3]:
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    sd_ours, sd_theirs = ours.state_dict(), theirs.state_dict()
    assert set(sd_ours["param_groups"][0]) == set(sd_theirs["param_groups"][0])
    st = sd_ours["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and float(st["step"]) == 3.0
    # swap: torch continues from our state, we continue from torch's
    a2, b2 = [p.detach().clone() for p in a], [q.detach().clone() for q in b]
    t2 = torch.optim.AdamW(a2, lr=1e-2, weight_decay=0.1, foreach=False)
    t2.load_state_dict(sd_ours)
    o2 = CpuAdam(b2, lr=1.0)
    o2.load_state_dict(sd_theirs)
    assert o2.param_groups[0]["lr"] == 1e-2
    for gs in grads[3:]:
        for p, q, g in zip(a2, b2, gs):
            p.grad, q.grad = g.clone(), g.clone()
        t2.step()
        o2.step()
    for p, q in zip(a2, b2):
        _assert_close(q, p)


def test_errors():
    p = torch.randn(4)
    with pytest.raises(ValueError):
        CpuAdam([p], lr=-1.0)
    o = CpuAdam([p])
    p.grad = torch.randn(4)
    with pytest.raises(ValueError, match="same size"):
        o.step(out16={p: torch.empty(3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="bf16/fp16"):
        o.step(out16={p: torch.empty(4, dtype=torch.float32)})
    o.param_groups[0]["amsgrad"] = True
    with pytest.raises(NotImplementedError):
        o.step()
    q = torch.randn(4)
    q.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        CpuAdam([q]).step()


def test_closure_and_return_value():
    p = torch.nn.Parameter(torch.randn(8))
    o = CpuAdam([p])

    def closure():
        o.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = o.step(closure)
    assert torch.is_tensor(loss) and p.grad is not None



def test_step_from_a_background_thread_with_one_kernel_thread():
    """The delayed-update pattern: the host step runs in another Python thread, on a fixed thread count."""
    import threading

    sizes = (100_003, 5)
    ours, ref = _params(sizes), _params(sizes)
    o = CpuAdam(ours, weight_decay=0.01, threads=1)
    r = torch.optim.AdamW(ref, weight_decay=0.01, foreach=False)
    for gs in _grads(sizes, 3):
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        th = threading.Thread(target=o.step)
        th.start()
        r.step()
        th.join()
    for p, q in zip(ours, ref):
        _assert_close(p, q)


def test_inexact_fast_mode_is_close_to_torch():
    """exact=False (DeepSpeed's sequence): not bit-exact; bounded by 4e-6 relative to max |p| after 10 steps
    at lr 3e-3 (measured: ~1e-7)."""
    ours, ref, *_ = _run_pair(lambda ps: CpuAdam(ps, lr=3e-3, weight_decay=0.01, exact=False),
                          lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01, foreach=False))
    worst = 0.0
    for p, q in zip(ours, ref):
        if p.numel():
            worst = max(worst, float((p - q).abs().max() / q.abs().max()))
    assert worst < 4e-6
