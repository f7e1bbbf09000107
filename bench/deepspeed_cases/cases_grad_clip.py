"""Cases from DeepSpeed's tests/unit/runtime/zero/test_zero_grad_clip.py (TestZeroGradClip), adapted as the others
are: bf16 where the original runs fp16 or bf16 (so its four parametrizations keep their clip values and offload
devices), torch's Adam, the harness's process group instead of the environment variables the test sets."""
import torch

from common import CASES, SimpleModel, adam, bf16, ds, param_cases  # noqa: F401

GRID = [dict(clip_value=c, offload_device=d) for c, d in ((0.5, "cpu"), (0.05, "cpu"), (0.5, "none"),
                                                          (0.05, "none"))]


@param_cases("TestZeroGradClip::test_grad_clip_and_norm_update", 1, GRID)
def grad_clip(clip_value, offload_device):
    deepspeed = ds()
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad
    cfg = {"train_batch_size": 8, "steps_per_print": 1, "optimizer": adam(1e-4),
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": offload_device},
                                 "contiguous_gradients": True, "overlap_comm": False},
           "gradient_clipping": 1.0, "bf16": bf16(), "zero_force_ds_cpu_optimizer": False}
    model = SimpleModel(hidden_dim=10)
    engine, optimizer, _, _ = deepspeed.initialize(args=None, model=model, config=cfg,
                                                   model_parameters=model.parameters(), dist_init_required=True)
    assert isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3)
    torch.manual_seed(1670)
    inputs = torch.randn(8, 10).bfloat16()
    targets = torch.randn(8, 10).bfloat16()
    loss = engine(inputs, targets)
    engine.backward(loss)
    pre = torch.linalg.vector_norm(torch.stack(optimizer._get_norm_groups()))
    modified = 0
    for param in engine.parameters():
        if not hasattr(param, "ds_id"):
            continue
        grad = safe_get_local_grad(param)
        if grad is not None:
            pre_norm = grad.norm().item()
            clamped = torch.clamp(grad, -clip_value, clip_value)
            if pre_norm > clip_value:
                assert clamped.norm().item() < pre_norm, f"param {param.ds_id}"
            safe_set_local_grad(param, clamped)
            modified += 1
    post = torch.linalg.vector_norm(torch.stack(optimizer._get_norm_groups()))
    assert modified > 0, "no parameter was clipped"
    assert post.item() < pre.item(), f"post-clip norm {post.item():.6f} >= pre-clip norm {pre.item():.6f}"
    engine.step()
    assert optimizer._global_grad_norm is not None
    if pre.item() > clip_value:
        assert post.item() < pre.item()
