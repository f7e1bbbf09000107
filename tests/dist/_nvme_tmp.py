import sys, tempfile, traceback
sys.path.insert(0, "/work/main/tests/dist"); sys.path.insert(0, "/work/main/tests")
from support.world import run_world
import test_recompute as T
def fn(rank, world, d, opt):
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": d}}
    if opt:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": d}
    T.CONFIGS["nvme"] = ({"zero_optimization": zero}, 1e-6)
    out = {}
    for how in ("none", "hf_nonreentrant", "trl_offload"):
        try:
            out[how] = T.run_cell(rank, world, "lora_llama", how, "nvme")
        except Exception as e:
            out[how] = repr(e)[:120]
    return out
if __name__ == "__main__":
    for opt in (False, True):
        with tempfile.TemporaryDirectory() as d:
            print(opt, run_world(fn, 4, d, opt, ranks_per_node=2)[0])
