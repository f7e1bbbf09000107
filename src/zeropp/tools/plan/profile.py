"""The measured speeds a plan is computed from: compute, quantizer, host work and each link, as one JSON file.

``zeropp plan --calibrate`` writes it; ``zeropp plan --profile p.json`` reads it. Without a profile the plan
uses the hardware given on the command line (``--gpu-tflops``, ``--inter-node-gbps``...) and
:data:`GPU_DEFAULTS` for what a command line does not say.

Link fits are alpha-beta in the ledger's units: ``seconds = alpha_s + received_bytes / bytes_per_s``, where
``received_bytes`` is what one rank receives in the collective (``comm/ops.py`` counts it; ``accounting.py``
computes it). A fit on a shaped link also carries ``wire_efficiency``: the bytes per second the pattern got on
the node's link (from the pattern's wire bytes, see ``collectives.py``) over the link's nominal rate.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

FORMAT = "zeropp-plan-profile/1"
#: Collective patterns the model times (what the engine issues).
PATTERNS = ("all_gather", "all_to_all", "all_reduce")


class PlanError(ValueError):
    """A plan input that cannot be used; the message names the option, key or file at fault."""


@dataclass(frozen=True)
class Fit:
    """``seconds = alpha_s + received_bytes / bytes_per_s`` for one collective pattern on one link."""

    alpha_s: float
    bytes_per_s: float
    wire_efficiency: Optional[float] = None  # achieved wire rate / nominal rate (shaped links only)

    def seconds(self, received_bytes: float) -> float:
        return self.alpha_s + received_bytes / self.bytes_per_s if received_bytes > 0 else 0.0


@dataclass(frozen=True)
class InterLink:
    """The node-crossing fits measured at one link setting (``gbps`` None: unshaped, no nominal rate)."""

    label: str
    gbps: Optional[float]
    fits: dict[str, Fit]  # "all_gather" / "all_to_all" over the world, "all_to_all_inter", "all_gather_inter"
    # (among one rank per node), "all_reduce"


@dataclass(frozen=True)
class Profile:
    """What ``zeropp plan --calibrate`` measured on one machine or cluster."""

    source: str  # "emulated-cluster" | "torchrun" | "loopback"
    machine: str
    nodes: int
    ranks_per_node: int
    device: str  # where the compute probes ran: "cpu" or "cuda"
    comm_uses_compute: bool  # collectives cost the same processors as compute (CPU ranks): they add up
    matmul_flops: float  # one rank, all ranks running at once
    step_flops: float  # 6 * params * tokens / (forward + backward seconds) of the probe model
    quantize_per_s: dict[str, float]  # elements per second by bit width ("8", "4")
    dequantize_per_s: dict[str, float]
    optimizer_per_s: float  # master elements per second through the engine's step (casts, norm, AdamW, recast)
    reduce_sum_per_s: float  # received elements per second summed in fp32 after an all-to-all reduce
    copy_bytes_per_s: float  # bucket packing and gradient accumulation
    intra: dict[str, Fit]  # inside a node: "all_gather", "all_to_all"
    inter: list[InterLink] = field(default_factory=list)
    # qgZ's fused steps 3 and 5 (input elements per second by bit width); older profiles lack them
    qgz_sum_requantize_per_s: dict[str, float] = field(default_factory=dict)
    qgz_sum_per_s: dict[str, float] = field(default_factory=dict)
    date: str = ""
    notes: str = ""

    def inter_for(self, gbps: Optional[float], label: Optional[str] = None) -> InterLink:
        """The inter-node fits for a link of ``gbps`` (or the setting named ``label``): the exact setting when it
        was measured, else the nearest shaped one (by rate ratio), else the unshaped one."""
        if not self.inter:
            raise PlanError("profile: no inter-node link was measured (links.inter is empty)")
        if label is not None:
            for link in self.inter:
                if link.label == label:
                    return link
            raise PlanError(f"profile: no inter-node setting named {label!r}; measured: "
                            + ", ".join(x.label for x in self.inter))
        shaped = [x for x in self.inter if x.gbps]
        if gbps is None or not shaped:
            unshaped = [x for x in self.inter if not x.gbps]
            return unshaped[0] if unshaped else self.inter[0]
        return min(shaped, key=lambda x: abs(math.log(x.gbps / gbps)))  # type: ignore[operator]

    def unshaped(self) -> Optional[InterLink]:
        return next((x for x in self.inter if not x.gbps), None)

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out = {"format": FORMAT, **out}
        return out

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)


def _fit(raw: Any, where: str) -> Fit:
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: expected an object with alpha_s and bytes_per_s")
    try:
        fit = Fit(float(raw["alpha_s"]), float(raw["bytes_per_s"]),
                  None if raw.get("wire_efficiency") is None else float(raw["wire_efficiency"]))
    except KeyError as err:
        raise PlanError(f"{where}.{err.args[0]}: missing") from None
    except (TypeError, ValueError):
        raise PlanError(f"{where}: alpha_s, bytes_per_s and wire_efficiency must be numbers") from None
    if fit.alpha_s < 0 or not fit.bytes_per_s > 0:
        raise PlanError(f"{where}: alpha_s must be >= 0 and bytes_per_s > 0, got {fit}")
    return fit


def _positive(raw: dict[str, Any], key: str, where: str) -> float:
    if key not in raw:
        raise PlanError(f"{where}.{key}: missing")
    try:
        value = float(raw[key])
    except (TypeError, ValueError):
        raise PlanError(f"{where}.{key}: must be a number, got {raw[key]!r}") from None
    if not value > 0:
        raise PlanError(f"{where}.{key}: must be > 0, got {value}")
    return value


def _rates(raw: dict[str, Any], key: str, where: str) -> dict[str, float]:
    table = raw.get(key)
    if not isinstance(table, dict) or not table:
        raise PlanError(f"{where}.{key}: expected an object of bit width -> elements per second")
    return {str(bits): _positive(table, bits, f"{where}.{key}") for bits in table}


def profile_from_json(raw: Any, where: str = "profile") -> Profile:
    """Validate a parsed profile; every problem is a :class:`PlanError` naming the key."""
    if not isinstance(raw, dict):
        raise PlanError(f"{where}: the top level must be a JSON object")
    if raw.get("format") != FORMAT:
        raise PlanError(f"{where}.format: expected {FORMAT!r}, got {raw.get('format')!r} "
                        "(write a profile with `zeropp plan --calibrate`)")
    intra_raw = raw.get("intra")
    if not isinstance(intra_raw, dict):
        raise PlanError(f"{where}.intra: expected an object of pattern -> fit")
    inter_raw = raw.get("inter")
    if not isinstance(inter_raw, list):
        raise PlanError(f"{where}.inter: expected a list of link settings")
    inter = []
    for i, item in enumerate(inter_raw):
        w = f"{where}.inter[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("fits"), dict):
            raise PlanError(f"{w}: expected an object with label, gbps and fits")
        gbps = item.get("gbps")
        if gbps is not None and not (isinstance(gbps, (int, float)) and gbps > 0):
            raise PlanError(f"{w}.gbps: must be a positive number or null, got {gbps!r}")
        inter.append(InterLink(str(item.get("label", f"link{i}")), gbps,
                               {k: _fit(v, f"{w}.fits.{k}") for k, v in item["fits"].items()}))
    try:
        nodes, rpn = int(raw["nodes"]), int(raw["ranks_per_node"])
    except (KeyError, TypeError, ValueError):
        raise PlanError(f"{where}.nodes / {where}.ranks_per_node: missing or not integers") from None
    return Profile(
        source=str(raw.get("source", "")), machine=str(raw.get("machine", "")), nodes=nodes, ranks_per_node=rpn,
        device=str(raw.get("device", "cpu")), comm_uses_compute=bool(raw.get("comm_uses_compute", False)),
        matmul_flops=_positive(raw, "matmul_flops", where), step_flops=_positive(raw, "step_flops", where),
        quantize_per_s=_rates(raw, "quantize_per_s", where), dequantize_per_s=_rates(raw, "dequantize_per_s", where),
        optimizer_per_s=_positive(raw, "optimizer_per_s", where),
        reduce_sum_per_s=_positive(raw, "reduce_sum_per_s", where),
        copy_bytes_per_s=_positive(raw, "copy_bytes_per_s", where),
        intra={k: _fit(v, f"{where}.intra.{k}") for k, v in intra_raw.items()},
        inter=inter, date=str(raw.get("date", "")), notes=str(raw.get("notes", "")),
        qgz_sum_requantize_per_s=_rates(raw, "qgz_sum_requantize_per_s", where) if raw.get(
            "qgz_sum_requantize_per_s") else {},
        qgz_sum_per_s=_rates(raw, "qgz_sum_per_s", where) if raw.get("qgz_sum_per_s") else {})


def load_profile(path: str) -> Profile:
    """Read a profile file; a missing file, bad JSON or a bad key is a :class:`PlanError` naming the file."""
    return profile_from_json(read_json_file("--profile", path), where=f"--profile {path}")


def read_json_file(flag: str, path: str, missing: str = "file not found") -> Any:
    """The JSON file given to ``flag``, read by the config's reader (``zeropp.config.read_json``: duplicate
    keys refused too); its errors become one :class:`PlanError` naming the option and the file."""
    from zeropp.config.loader import ConfigError, read_json

    try:
        return read_json(path)
    except ConfigError as err:
        problem = err.problems[0]
        raise PlanError(f"{flag} {path}: {missing if problem == 'file not found' else problem}") from None
