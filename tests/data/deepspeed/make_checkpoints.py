#!/usr/bin/env python
"""Write real DeepSpeed ZeRO checkpoints of tests/support/ds_reference.py's model, plus references that DeepSpeed
itself computes, so a DeepSpeed-free importer can be tested against them.

Run it with a Python that has deepspeed==0.19.8 and torch installed (CPU only, no GPU needed):

    /work/dsenv/bin/python tests/data/deepspeed/make_checkpoints.py [case ...]

Cases: stage2_fp32 stage2_bf16 stage3_fp32 stage3_bf16 (default: all). Each case trains on 2 ranks (gloo,
DS_ACCELERATOR=cpu, torch.multiprocessing spawn), saves a checkpoint into tests/data/deepspeed/<case>/ exactly as
DeepSpeed writes it, and writes into <case>/reference/ (safetensors and JSON only):

    fp32_weights.safetensors            deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(<case>)
    fp32_params_live.safetensors        safe_get_full_fp32_param(p) for every parameter, right after the save
    optimizer_state.safetensors         safe_get_full_optimizer_state(p, "exp_avg"/"exp_avg_sq"), keys <name>.exp_avg
    optimizer_steps.json                Adam's step as DeepSpeed holds it (live and in the files)
    continued_losses.json               losses/lrs of steps 0..2 and, after load_checkpoint into a fresh engine, 3..7
    fp32_params_after_continue.safetensors  safe_get_full_fp32_param(p) after those 5 continued steps
    layout.json                         every file's name and its full unpickled structure, the pickled globals,
                                        and what torch.load(weights_only=True) says about each file

At the end rank 0 re-assembles the fp32 master weights and Adam's exp_avg/exp_avg_sq from the *_optim_states.pt
files with plain torch (the layout rules in README.md) and asserts they equal DeepSpeed's own answers bit for bit.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import gc
import hashlib
import json
import math
import os
import pickletools
import re
import shutil
import socket
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.normpath(os.path.join(HERE, "..", "..", "support"))
sys.path.insert(0, SUPPORT)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2
TRAIN_STEPS = 3
CONTINUE_STEPS = 5
INIT_SEED = 0
FRESH_SEED = 1234
CLIENT_STATE = {"epoch": 1, "note": "hello"}
CASES = {  # name: (zero stage, bf16)
    "stage2_fp32": (2, False),
    "stage2_bf16": (2, True),
    "stage3_fp32": (3, False),
    "stage3_bf16": (3, True),
}


def ds_config(stage: int, bf16: bool) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}},
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


# ----------------------------------------------------------------------------------------------------------------
# plain-torch reassembly (the rules README.md describes); used as the proof in verify()
# ----------------------------------------------------------------------------------------------------------------

OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def load_pickle(path: str):
    return torch.load(path, map_location="cpu", weights_only=False)


def reassemble(tag_dir: str) -> dict:
    """fp32 master weights, exp_avg, exp_avg_sq and step from the files of one checkpoint tag directory."""
    optim = sorted((int(m.group(2)), f) for f in os.listdir(tag_dir) if (m := OPTIM_RE.match(f)))
    assert [r for r, _ in optim] == list(range(len(optim))), optim
    osd = [load_pickle(os.path.join(tag_dir, f))["optimizer_state_dict"] for _, f in optim]
    world = len(osd)
    stage = int(osd[0]["zero_stage"])
    ms_name = "mp_rank_00_model_states.pt" if stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    ms = load_pickle(os.path.join(tag_dir, ms_name))
    param_shapes = ms["param_shapes"]  # list (one per param group) of OrderedDict name -> torch.Size
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "step": [], "buffers": {}}
    for name in ms["buffer_names"]:
        out["buffers"][name] = ms["module"][name]

    if stage <= 2:
        pc = osd[0]["partition_count"]
        assert pc == [world] * len(param_shapes), pc
        for g, shapes in enumerate(param_shapes):
            pads = osd[0]["param_alignment_paddings"][g]
            # fp32 master: every rank's unpadded slice, concatenated, is the group's flat buffer without its tail pad
            flat = torch.cat([o["single_partition_of_fp32_groups"][g] for o in osd])
            total = sum(math.prod(s) for s in shapes.values()) + sum(pads)
            assert flat.numel() == total, (flat.numel(), total)
            # Adam state: every rank's slice is padded to the same partition size (group padded to 2*world)
            part = math.ceil(total / (2 * world)) * (2 * world) // world
            st = [o["base_optimizer_state"]["state"][g] for o in osd]
            for r in range(world):
                for k in ("exp_avg", "exp_avg_sq"):
                    assert st[r][k].numel() == part, (r, k, st[r][k].numel(), part)
                # the tail pad lives in the highest ranks; the lean fp32 slice drops exactly group_paddings[g]
                assert osd[r]["single_partition_of_fp32_groups"][g].numel() == part - osd[r]["group_paddings"][g]
            flat_k = {k: torch.cat([s[k] for s in st]) for k in ("exp_avg", "exp_avg_sq")}
            out["step"].append([float(s["step"]) for s in st])
            off = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                out["fp32"][name] = flat[off:off + n].view(shape).clone()
                for k in flat_k:
                    out[k][name] = flat_k[k][off:off + n].view(shape).clone()
                off += n + pads[i]
            assert off == total
    else:
        assert osd[0]["partition_count"] == world, osd[0]["partition_count"]
        shapes = {k: v for group in param_shapes for k, v in group.items()}
        inner = [o["optimizer_state_dict"] for o in osd]  # torch optimizer state_dict, one entry per sub-group
        n_sub = len(osd[0]["fp32_flat_groups"])
        for o, s in zip(osd, inner):
            assert len(o["fp32_flat_groups"]) == n_sub and sorted(s["state"]) == list(range(n_sub))
        flat = [torch.cat(list(o["fp32_flat_groups"])) for o in osd]
        flat_k = {k: [torch.cat([s["state"][i][k] for i in range(n_sub)]) for s in inner]
                  for k in ("exp_avg", "exp_avg_sq")}
        out["step"] = [[float(s["state"][i]["step"]) for s in inner] for i in range(n_sub)]
        off = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            part = math.ceil(n / world)  # every rank holds ceil(numel/world); the last ranks' tail is zero padding
            out["fp32"][name] = torch.cat([f[off:off + part] for f in flat])[:n].view(shape).clone()
            for k in flat_k:
                out[k][name] = torch.cat([f[off:off + part] for f in flat_k[k]])[:n].view(shape).clone()
            off += part
        for r in range(world):
            assert flat[r].numel() == off, (flat[r].numel(), off)
    return out


# ----------------------------------------------------------------------------------------------------------------
# layout description
# ----------------------------------------------------------------------------------------------------------------

def qualname(obj_or_type) -> str:
    t = obj_or_type if isinstance(obj_or_type, type) else type(obj_or_type)
    return f"{t.__module__}.{t.__qualname__}"


PLAIN = (int, float, str, bool, type(None))


def describe(obj, path: str, entries: dict, classes: set) -> None:
    t = type(obj)
    if t.__module__ != "builtins":
        classes.add(qualname(t))
    d = {"type": qualname(t)}
    entries[path] = d
    if isinstance(obj, torch.Tensor):
        d.update(dtype=str(obj.dtype), shape=list(obj.shape))
        if obj.numel() <= 4:
            d["value"] = obj.float().tolist() if obj.is_floating_point() else obj.tolist()
        if obj.requires_grad:
            d["requires_grad"] = True
        extra = getattr(obj, "__dict__", None)
        if extra:  # a tensor with Python attributes pickles through torch._tensor._rebuild_from_type_v2
            d["tensor_attrs"] = {k: (v if isinstance(v, PLAIN) else repr(v)[:100]) for k, v in extra.items()}
    elif isinstance(obj, torch.Size):
        d["value"] = list(obj)
    elif isinstance(obj, (torch.dtype, torch.device)):
        d["value"] = str(obj)
    elif isinstance(obj, enum.Enum):
        d.update(name=obj.name, value=obj.value if isinstance(obj.value, PLAIN) else repr(obj.value))
    elif isinstance(obj, PLAIN):
        d["value"] = obj
    elif isinstance(obj, dict):
        d["len"] = len(obj)
        for k, v in obj.items():
            describe(v, f"{path}[{k!r}]", entries, classes)
    elif isinstance(obj, (list, tuple)):
        d["len"] = len(obj)
        if len(obj) <= 16 and all(isinstance(v, PLAIN) for v in obj):
            d["value"] = list(obj)
        else:
            for i, v in enumerate(obj):
                describe(v, f"{path}[{i}]", entries, classes)
    elif hasattr(obj, "__dict__"):
        d["attrs"] = sorted(vars(obj))
        for k, v in vars(obj).items():
            describe(v, f"{path}.{k}", entries, classes)
    else:
        d["repr"] = repr(obj)[:200]


def pickle_globals(path: str) -> list[str]:
    """Every global (module.qualname) the pickle inside a torch.save zip file references, from its opcodes."""
    with zipfile.ZipFile(path) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            mod, name = arg.split(" ", 1)
            found.add(f"{mod}.{name}")
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":  # not used by torch.save's protocol 2; best effort if it ever is
            found.add(f"{strings[-2]}.{strings[-1]}")
    return sorted(found)


def global_uses(path: str) -> dict:
    """For each non-torch global: how the pickle uses it (the opcode that consumes it: REDUCE with its args' opcodes,
    or NEWOBJ followed by BUILD with a dict state), so a restricted unpickler knows what to support."""
    with zipfile.ZipFile(path) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    ops = list(pickletools.genops(data))
    uses: dict[str, set] = {}
    for i, (op, arg, _) in enumerate(ops):
        if op.name != "GLOBAL" or arg.startswith(("torch", "collections")):
            continue
        name = arg.replace(" ", ".")
        nxt = [o.name for o, _, _ in ops[i + 1:i + 7] if o.name not in ("BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT")]
        if nxt[:2] == ["EMPTY_TUPLE", "NEWOBJ"] and nxt[2] == "EMPTY_DICT":
            uses.setdefault(name, set()).add("EMPTY_TUPLE NEWOBJ (cls.__new__(cls)), then BUILD with a dict of attributes")
        elif "REDUCE" in nxt:
            args = [(o.name, a) for o, a, _ in ops[i + 1:i + 7] if o.name not in ("BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT")]
            args = args[:[n for n, _ in args].index("REDUCE") + 1]
            uses.setdefault(name, set()).add("cls(*args) via REDUCE: " + " ".join(
                f"{n}({a})" if a is not None else n for n, a in args))
        else:
            uses.setdefault(name, set()).add("other: " + " ".join(nxt))
    return {k: sorted(v) for k, v in sorted(uses.items())}


# Stand-ins for DeepSpeed's pickled classes, to show that torch.load(weights_only=True) reads every file without
# DeepSpeed once these names are allowlisted (torch.serialization.safe_globals([(obj, "module.qualname")])).
class StubLossScaler:
    pass


class StubZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class StubFragmentAddress:
    numel: int
    start: int


STUBS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": StubLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": StubZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": StubFragmentAddress,
}


def load_with_stubs(path: str) -> dict:
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    missing = [g for g in needed if g not in STUBS]
    if missing:
        return {"ok": False, "error": f"no stub for {missing}"}
    try:
        with torch.serialization.safe_globals([(STUBS[g], g) for g in needed]):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "allowlisted": sorted(needed), "error_type": qualname(e), "error": str(e)}
    ref = load_pickle(path)
    same = _same_tree(obj, ref)
    return {"ok": True, "allowlisted": sorted(needed), "tree_equal_to_weights_only_false": same}


def _same_tree(a, b) -> bool:
    if isinstance(b, torch.Tensor):  # bitwise: ZeRO-3 padding is uninitialised memory and can hold NaNs
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(b, enum.Enum):
        return isinstance(a, enum.Enum) and a.value == b.value and a.name == b.name
    if type(b).__module__.startswith("deepspeed"):
        return vars(a) == vars(b)
    return a == b


def pickle_protocol(path: str) -> int:
    with zipfile.ZipFile(path) as z:
        (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        data = z.read(pkl)
    for op, arg, _ in pickletools.genops(data):
        if op.name == "PROTO":
            return arg
    return 0


def file_kind(name: str) -> str:
    if name == "latest":
        return "latest"
    if name.endswith(".py"):
        return "recovery_script"
    if re.match(r"^mp_rank_\d+_model_states\.pt$", name):
        return "model_states"
    if re.match(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$", name):
        return "zero3_model_states"
    if OPTIM_RE.match(name):
        return "optim_states"
    return "other"


def write_layout(case_dir: str, out_path: str) -> dict:
    import deepspeed
    files, per_kind_globals, per_kind_classes = {}, {}, {}
    for root, dirs, names in os.walk(case_dir):
        dirs[:] = sorted(d for d in dirs if os.path.join(root, d) != os.path.join(case_dir, "reference"))
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, case_dir)
            kind = file_kind(name)
            info = {"kind": kind, "bytes": os.path.getsize(path)}
            if kind == "latest":
                info["content"] = open(path).read()
            elif kind == "recovery_script":
                src = os.path.join(os.path.dirname(deepspeed.__file__), "utils", name)
                info["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
                info["identical_to"] = f"deepspeed/utils/{name}" if open(src, "rb").read() == open(path, "rb").read() else None
            elif name.endswith(".pt"):
                obj = load_pickle(path)
                entries, classes = {}, set()
                describe(obj, "", entries, classes)
                info["pickle_protocol"] = pickle_protocol(path)
                info["pickled_globals"] = pickle_globals(path)
                info["object_classes"] = sorted(classes)
                try:
                    torch.load(path, map_location="cpu", weights_only=True)
                    info["weights_only_true"] = {"ok": True}
                except Exception as e:  # noqa: BLE001 - the text is the point
                    info["weights_only_true"] = {"ok": False, "error_type": qualname(e), "error": str(e)}
                info["unsafe_globals"] = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
                info["global_uses"] = global_uses(path)
                info["weights_only_true_with_stub_allowlist"] = load_with_stubs(path)
                assert info["weights_only_true_with_stub_allowlist"]["ok"], info["weights_only_true_with_stub_allowlist"]
                assert info["weights_only_true_with_stub_allowlist"]["tree_equal_to_weights_only_false"]
                info["structure"] = entries
                per_kind_globals.setdefault(kind, set()).update(info["pickled_globals"])
                per_kind_classes.setdefault(kind, set()).update(classes)
            files[rel] = info
    layout = {
        "made_by": "tests/data/deepspeed/make_checkpoints.py",
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "path_notation": "'' is the unpickled root; [k] indexes a dict/list with key repr k (so [0] on a dict is an "
                         "int key, ['x'] a str key); .a is an attribute of a plain object (its __dict__)",
        "files": files,
        "pickled_globals_by_kind": {k: sorted(v) for k, v in sorted(per_kind_globals.items())},
        "object_classes_by_kind": {k: sorted(v) for k, v in sorted(per_kind_classes.items())},
    }
    with open(out_path, "w") as f:
        json.dump(layout, f, indent=1)
    return layout


# ----------------------------------------------------------------------------------------------------------------
# the training processes
# ----------------------------------------------------------------------------------------------------------------

def save_tensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, path, metadata=metadata)


def full_fp32(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).detach().cpu().float().clone() for n, p in engine.module.named_parameters()}


def full_opt_state(engine) -> dict:
    from deepspeed.utils import safe_get_full_optimizer_state
    out = {}
    for n, p in engine.module.named_parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{k}"] = safe_get_full_optimizer_state(p, k).detach().cpu().clone()
    return out


def live_steps(engine, stage: int) -> dict:
    """Adam's step as DeepSpeed holds it in this rank's process."""
    zopt = engine.optimizer
    flats = zopt.single_partition_of_fp32_groups if stage <= 2 else zopt.fp32_partitioned_groups_flat
    attr = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_partitioned_groups_flat"
    steps = []
    for i, flat in enumerate(flats):
        st = zopt.optimizer.state[flat]["step"]
        steps.append({"source": f"engine.optimizer.optimizer.state[engine.optimizer.{attr}[{i}]]['step']",
                      "type": qualname(st), "dtype": str(st.dtype) if torch.is_tensor(st) else None,
                      "shape": list(st.shape) if torch.is_tensor(st) else None, "value": float(st)})
    return {"basic_optimizer": qualname(zopt.optimizer), "zero_optimizer": qualname(zopt),
            "engine.global_steps": engine.global_steps, "per_group": steps}


def run_case(rank: int, case: str, port: int, ext_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      TORCH_EXTENSIONS_DIR=ext_dir)
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from ds_reference import make_model, ds_batch, ds_loss

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    stage, bf16 = CASES[case]
    cfg = ds_config(stage, bf16)
    case_dir = os.path.join(HERE, case)
    ref_dir = os.path.join(case_dir, "reference")
    if rank == 0:
        os.makedirs(ref_dir, exist_ok=True)
    dist.barrier()

    def gather(obj):
        out = [None] * WORLD
        dist.all_gather_object(out, obj)
        return out

    # ---- train 3 steps and save -------------------------------------------------------------------------------
    model = make_model(INIT_SEED)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    first = []
    for step in range(TRAIN_STEPS):
        x, y = ds_batch(step, rank)
        lr = engine.get_lr()[0]  # the lr this step's optimizer update uses
        loss = ds_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        first.append({"step": step, "loss": loss.item(), "lr": lr})
    engine.save_checkpoint(case_dir, client_state=copy.deepcopy(CLIENT_STATE))

    # ---- DeepSpeed's own view right after the save (collectives: every rank calls) ----------------------------
    live = full_fp32(engine)
    opt_state = full_opt_state(engine)
    steps = gather(live_steps(engine, stage))
    lives = gather(live)
    opts = gather(opt_state)
    for r in range(1, WORLD):  # full tensors, identical on every rank
        assert all(torch.equal(lives[0][k], lives[r][k]) for k in live)
        assert all(torch.equal(opts[0][k], opts[r][k]) for k in opt_state)
    first_all = gather(first)
    dist.barrier()
    if rank == 0:
        z2f = get_fp32_state_dict_from_zero_checkpoint(case_dir)
        save_tensors(z2f, os.path.join(ref_dir, "fp32_weights.safetensors"),
                     {"source": "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(<case dir>)"})
        save_tensors(live, os.path.join(ref_dir, "fp32_params_live.safetensors"),
                     {"source": "deepspeed.utils.safe_get_full_fp32_param(param) right after save_checkpoint"})
        save_tensors(opt_state, os.path.join(ref_dir, "optimizer_state.safetensors"),
                     {"source": "deepspeed.utils.safe_get_full_optimizer_state(param, key) right after save_checkpoint"})
    dist.barrier()

    # ---- a fresh engine (different init) loads the checkpoint and trains 5 more steps ---------------------------
    del engine
    gc.collect()
    model2 = make_model(FRESH_SEED)
    engine2, _, _, _ = deepspeed.initialize(model=model2, model_parameters=model2.parameters(),
                                            config=copy.deepcopy(cfg))
    load_path, client_sd = engine2.load_checkpoint(case_dir)
    after_load = {"global_steps": engine2.global_steps, "lr": engine2.get_lr()[0],
                  "lr_scheduler": engine2.lr_scheduler.state_dict()}
    loaded_fp32 = full_fp32(engine2)
    for k in live:  # the load restores DeepSpeed's fp32 master exactly
        assert torch.equal(loaded_fp32[k], live[k]), k
    cont = []
    for step in range(TRAIN_STEPS, TRAIN_STEPS + CONTINUE_STEPS):
        x, y = ds_batch(step, rank)
        lr = engine2.get_lr()[0]
        loss = ds_loss(engine2, x, y)
        engine2.backward(loss)
        engine2.step()
        cont.append({"step": step, "loss": loss.item(), "lr": lr})
    final = full_fp32(engine2)
    cont_all = gather(cont)
    if rank == 0:
        save_tensors(final, os.path.join(ref_dir, "fp32_params_after_continue.safetensors"),
                     {"source": "safe_get_full_fp32_param(param) after load_checkpoint + 5 steps (steps 3..7)"})
        doc = {
            "what": "per-rank loss (float of the fp32 MSE) and the lr each optimizer step used (engine.get_lr()[0] "
                    "read just before engine.step()); step s uses ds_batch(s, rank); 'first' are steps 0..2 of the "
                    "engine that saved, 'continued' are steps 3..7 of a fresh engine (model seed %d) after "
                    "engine.load_checkpoint(<case dir>)" % FRESH_SEED,
            "world_size": WORLD, "zero_stage": stage, "bf16": bf16, "init_seed": INIT_SEED, "fresh_seed": FRESH_SEED,
            "config": cfg,
            "first": {str(r): first_all[r] for r in range(WORLD)},
            "load_checkpoint": {"returned_path": os.path.relpath(load_path, HERE),
                                "returned_client_state": {k: v for k, v in client_sd.items()
                                                          if isinstance(v, (int, float, str, bool))},
                                **after_load},
            "continued": {str(r): cont_all[r] for r in range(WORLD)},
        }
        with open(os.path.join(ref_dir, "continued_losses.json"), "w") as f:
            json.dump(doc, f, indent=1)
        with open(os.path.join(ref_dir, "optimizer_steps.json"), "w") as f:
            json.dump({"what": "Adam's step count after 3 optimizer steps, read in each training process right after "
                               "save_checkpoint from the base torch optimizer's state (one flat fp32 partition per "
                               "param group (ZeRO-1/2) or sub-group (ZeRO-3)); 'in_files' says where the files hold it",
                       "per_rank": {str(r): steps[r] for r in range(WORLD)},
                       "in_files": ("optim_states: ['optimizer_state_dict']['base_optimizer_state']['state'][g]['step'] "
                                    "(0-dim fp32 tensor)") if stage <= 2 else
                                   ("optim_states: ['optimizer_state_dict']['optimizer_state_dict']['state'][sub_group]"
                                    "['step'] (0-dim fp32 tensor)")}, f, indent=1)
        write_layout(case_dir, os.path.join(ref_dir, "layout.json"))
        verify(case, case_dir)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# the proof: our plain-torch reading of the files equals DeepSpeed's answers
# ----------------------------------------------------------------------------------------------------------------

def verify(case: str, case_dir: str) -> None:
    from safetensors.torch import load_file
    stage, bf16 = CASES[case]
    ref = os.path.join(case_dir, "reference")
    tag = open(os.path.join(case_dir, "latest")).read()
    assert tag == f"global_step{TRAIN_STEPS}", tag
    tag_dir = os.path.join(case_dir, tag)
    z2f = load_file(os.path.join(ref, "fp32_weights.safetensors"))
    live = load_file(os.path.join(ref, "fp32_params_live.safetensors"))
    opt = load_file(os.path.join(ref, "optimizer_state.safetensors"))
    mine = reassemble(tag_dir)

    names = list(live)
    assert set(z2f) == set(names) | {"out_shift"}, sorted(z2f)
    for n in names:
        assert mine["fp32"][n].dtype == torch.float32
        assert torch.equal(mine["fp32"][n], z2f[n]), n  # bit for bit (fp32 equality, no NaNs here)
        assert torch.equal(mine["fp32"][n], live[n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[k][n], opt[f"{n}.{k}"]), (n, k)
    for r_steps in mine["step"]:
        assert r_steps == [float(TRAIN_STEPS)] * WORLD, mine["step"]
    steps_doc = json.load(open(os.path.join(ref, "optimizer_steps.json")))
    for r in range(WORLD):
        assert [g["value"] for g in steps_doc["per_rank"][str(r)]["per_group"]] == [float(TRAIN_STEPS)] * len(mine["step"])
    # buffers: in the module state dict; DeepSpeed 0.19.8 casts only parameters to bf16 (buffers keep their dtype
    # unless a buffer dtype is configured); zero_to_fp32 returns floating buffers as fp32
    assert torch.equal(mine["buffers"]["out_shift"].float(), z2f["out_shift"])
    assert mine["buffers"]["out_shift"].dtype == torch.float32
    assert torch.equal(mine["buffers"]["out_shift"], torch.tensor([0.25, -0.5, 0.125, 0.0, 1.0]))

    # the model-states files
    ms_names = (["mp_rank_00_model_states.pt"] if stage <= 2
                else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(WORLD)])
    lp = torch.bfloat16 if bf16 else torch.float32
    for ms_name in ms_names:
        ms = load_pickle(os.path.join(tag_dir, ms_name))
        assert ms["ds_version"] == "0.19.8" and ms["global_steps"] == TRAIN_STEPS and ms["global_samples"] == 12
        assert ms["lr_scheduler"] == {"last_batch_iteration": TRAIN_STEPS - 1}, ms["lr_scheduler"]
        assert ms["optimizer"] is None and ms["buffer_names"] == ["out_shift"]
        assert ms["epoch"] == 1 and ms["note"] == "hello"
        assert ms["dp_world_size"] == WORLD and ms["mp_world_size"] == 1
        assert list(ms["module"]) == list(z2f) or set(ms["module"]) == set(z2f)
        for n in names:
            t = ms["module"][n]
            assert t.dtype == lp, (n, t.dtype)
            if stage <= 2:  # ZeRO-1/2: the full low-precision weights, = the fp32 master rounded to the model dtype
                assert torch.equal(t, z2f[n].to(lp)), n
            else:  # ZeRO-3: a placeholder (the param's data outside a gather), no weights
                assert t.numel() == 0, (n, t.shape)
    # the optim-states files
    for r in range(WORLD):
        prefix = "bf16_" if bf16 else ""
        o = load_pickle(os.path.join(tag_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        assert o["ds_version"] == "0.19.8"
        # ZeRO-1/2's optimizer state_dict carries its own ds_version; ZeRO-3's does not
        assert o["optimizer_state_dict"].get("ds_version") == ("0.19.8" if stage <= 2 else None)
        assert int(o["optimizer_state_dict"]["zero_stage"]) == stage
    # ZeRO-3 bf16: the saved fp32 master is the live one; the model's bf16 params are its rounding
    print(f"[{case}] verified: plain-torch reassembly == zero_to_fp32 == safe_get_full_fp32_param; "
          f"exp_avg/exp_avg_sq == safe_get_full_optimizer_state; step == {TRAIN_STEPS}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    import deepspeed
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    cases = argv or list(CASES)
    ext_dir = tempfile.mkdtemp(prefix="ds_ext_")  # DeepSpeed builds its small shm op here once (g++)
    try:
        for case in cases:
            case_dir = os.path.join(HERE, case)
            shutil.rmtree(case_dir, ignore_errors=True)
            mp.spawn(run_case, args=(case, free_port(), ext_dir), nprocs=WORLD, join=True)
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's own code: not shipped
                os.remove(os.path.join(case_dir, script))
    finally:
        shutil.rmtree(ext_dir, ignore_errors=True)


if __name__ == "__main__":
    os.environ["DS_ACCELERATOR"] = "cpu"
    main(sys.argv[1:])
