"""Cases from DeepSpeed's tests/unit/runtime/zero/test_zeropp.py, adapted as the others are (bf16 where the test runs
fp16, so its fixed loss scales drop out; torch's Adam): the hpZ partition size read back from the ZeRO config, and
TestZeroPPConfigSweep on 4 ranks (hidden 1024, 9 layers, hpZ groups of 1, 2 and 4), which reads each parameter's
secondary (hpZ) partition through ``ds_secondary_tensor``. The tests of DeepSpeed's quantizer kernel and of its
private ``Init._partition_param_sec`` are not API and are left out."""
import torch
import torch.distributed as dist
from torch import nn

from common import CASES, adam, bf16, case, destroy, ds, param_cases, random_batches  # noqa: F401


class NNModel(nn.Module):
    def __init__(self, h_dim=1024, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(h_dim, h_dim) for _ in range(n_layers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return self.cross_entropy_loss(x, y)


@case("test_zero_hpz_partition_size_config")
def hpz_partition_size_config():
    ds()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    config = DeepSpeedZeroConfig(**{"zero_hpz_partition_size": 4})
    assert config.zero_hpz_partition_size == 4


def _no_secondary_group(model):
    for _, param in model.named_parameters():
        assert param.ds_secondary_tensor is None
        assert param.ds_zero_param_process_group is None


def _secondary_exists(model):
    return any(param.ds_secondary_tensor is not None for _, param in model.named_parameters())


def _secondary_size(model):
    for name, param in model.named_parameters():
        assert param.ds_secondary_tensor is not None, f"param {param.ds_id}:{name} does not have secondary tensor"
        assert param.ds_secondary_tensor.size()[0] % param.ds_tensor.size()[0] == 0


def _config(zpg, quantized=False, gas=None):
    zero = {"stage": 3, "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": zpg, "contiguous_gradients": True,
            "overlap_comm": True}
    if quantized:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "optimizer": adam(1.0), "bf16": bf16()}
    if gas:
        cfg["gradient_accumulation_steps"] = gas
    return cfg


def _engine(cfg, h_dim, n_layers):
    deepspeed = ds()
    model = NNModel(h_dim, n_layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batches = random_batches(None, 20, h_dim, 1, dtype=torch.bfloat16)
    dist.barrier()
    return engine, batches


GRID = [dict(h_dim=1024, n_layers=9, zpg=z) for z in (1, 2, 4)]


@param_cases("TestZeroPPConfigSweep::test", 4, GRID)
def sweep_train(h_dim, n_layers, zpg):
    engine, batches = _engine(_config(zpg, quantized=True), h_dim, n_layers)
    if zpg == 1:
        _no_secondary_group(engine)
    for n, (x, y) in enumerate(batches):
        if n == 0 and zpg != 1:
            _secondary_size(engine)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    destroy(engine)


@param_cases("TestZeroPPConfigSweep::test_eval", 4, GRID)
def sweep_eval(h_dim, n_layers, zpg):
    engine, batches = _engine(_config(zpg), h_dim, n_layers)
    if zpg == 1:
        _no_secondary_group(engine)
    for x, y in batches:
        if zpg != 1:  # hpZ is on in eval when the previous iteration did not update the model
            _secondary_size(engine)
        with torch.no_grad():
            engine(x, y)
    destroy(engine)


@param_cases("TestZeroPPConfigSweep::test_gradient_accumulation", 4, GRID)
def sweep_accumulation(h_dim, n_layers, zpg):
    engine, batches = _engine(_config(zpg, gas=3), h_dim, n_layers)
    if zpg == 1:
        _no_secondary_group(engine)
    for n, (x, y) in enumerate(batches):
        if n == 0 and zpg != 1:
            _secondary_size(engine)
        if n > 0 and n % 3 != 0 and zpg != 1:  # inside the window the weights did not change: hpZ is on
            assert _secondary_exists(engine), f"n={n}"
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    destroy(engine)
