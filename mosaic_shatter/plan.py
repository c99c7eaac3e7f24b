"""Pure planning: which tensor goes where, the sizes of the outputs, and what cannot be converted.

`make_plan` reads only the checkpoint's config and tensor inventory (headers), never weights, so it
serves both `probe` and `convert`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from mosaic_runtime.vault.format import (HEADER_QUANTS, PROJECTIONS, QuantType, ScaleDtype, encode_meta, plan_header,
                                         projection_shape, record_layout)

from .architectures import Architecture, Role, UnsupportedModel, architecture_for
from . import int4_source, mxfp4_source
from .checkpoint import DTYPE_BYTES, Checkpoint, TensorInfo

FLOAT_DTYPES = ("BF16", "F16", "F32")
FP8_DTYPE = "F8_E4M3"
INT4_DTYPE = "INT4_G32"  # compressed-tensors pack-quantized int4 (int4_source): stored as I32 words
MXFP4_DTYPE = "MXFP4"  # OCP MXFP4 blocks and E8M0 scales (mxfp4_source): stored as U8
SCALE_DTYPES = {"BF16": ScaleDtype.BF16, "F32": ScaleDtype.F32}
CHUNK_BYTES = 64 << 20  # backbone tensors are converted in chunks of about this many bytes
BASELINE_RAM = 600 << 20  # Python, torch and the safetensors handles, measured in benchmarks/
LINEAGE_ALLOWANCE = 4096  # bytes reserved in size estimates for the lineage block


@dataclass(frozen=True)
class ProjectionSource:
    """Where one projection of one expert comes from."""

    tensor: str
    index: tuple = ()  # slice of the source tensor: () whole, (e,) or (e, slice) for fused tensors
    scale: str | None = None  # block-FP8 weight_scale_inv, int4 weight_scale or MXFP4 _scales tensor, if any
    rows: slice | None = None  # the rows of what `index` reads that are this projection (interleaved gate/up)
    transposed: bool = False  # the source holds it [in, out] (gpt-oss's float experts)
    bias: str | None = None  # the projection's bias, read at the same index and rows


@dataclass(frozen=True)
class BackboneTensor:
    name: str
    dtype: str  # output dtype (safetensors spelling)
    shape: tuple[int, ...]
    source: TensorInfo
    scale: str | None = None  # FP8 source weights are dequantised with this scale

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


@dataclass
class Plan:
    architecture: Architecture
    arch: dict
    source_format: dict
    experts: dict[tuple[int, int], dict[str, ProjectionSource]] = field(default_factory=dict)
    backbone: list[BackboneTensor] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)  # tensor left out -> its part (OPTIONAL_PARTS)
    problems: list[str] = field(default_factory=list)
    expert_bias: bool = False  # every expert has biases: the vault's records carry them (FLAG_EXPERT_BIAS)

    @property
    def hidden(self) -> int:
        return self.arch["hidden_size"]

    @property
    def intermediate(self) -> int:
        return self.arch["moe_intermediate_size"]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.arch["layer_kinds"]) if k == "moe"]

    def fp8_passthrough(self) -> bool:
        """FP8 source experts in 128 x 128 blocks are copied bit for bit into an FP8 vault."""
        return self.source_format["expert_dtype"] == FP8_DTYPE and self.source_format.get("fp8_block") == [128, 128]

    def passthrough(self, quant: QuantType) -> bool:
        """The source's expert codes go into a vault of this quant type as they are: FP8 blocks into FP8,
        packed int4 in groups of 32 into Q4 (int4_source), MXFP4 blocks into MXFP4 (mxfp4_source)."""
        if quant is QuantType.FP8_B128:
            return self.fp8_passthrough()
        if quant is QuantType.MXFP4_G32:
            return self.source_format["expert_dtype"] == MXFP4_DTYPE
        return self.source_format["expert_dtype"] == INT4_DTYPE

    def scale_dtype(self, quant: QuantType) -> ScaleDtype:
        if quant is QuantType.Q4_G32:
            return ScaleDtype.F16
        if quant is QuantType.MXFP4_G32:
            return ScaleDtype.E8M0
        if self.fp8_passthrough():
            return SCALE_DTYPES[self.source_format["fp8_scale_dtype"]]
        return ScaleDtype.F32

    def record_bytes(self, quant: QuantType) -> int:
        return record_layout(quant, self.scale_dtype(quant), self.hidden, self.intermediate,
                             self.expert_bias).record_bytes

    def vault_bytes(self, quant: QuantType, lineage_length: int = LINEAGE_ALLOWANCE) -> int:
        header = plan_header(quant, self.scale_dtype(quant), self.arch["num_hidden_layers"],
                             self.arch["num_experts"], self.hidden, self.intermediate, len(self.experts),
                             len(encode_meta(self.arch)), lineage_length, self.expert_bias)
        return header.file_size

    @property
    def backbone_bytes(self) -> int:
        return sum(t.nbytes for t in self.backbone)

    def workers_for(self, memory: int, threads: int) -> int:
        """Encoding threads for a convert: `threads` of them, fewer where peak_ram_bytes would not fit in
        `memory` (at least one: the smallest convert is what it is)."""
        workers = max(1, threads)
        while workers > 1 and self.peak_ram_bytes(workers) > memory:
            workers -= 1
        return workers

    def peak_ram_bytes(self, workers: int) -> int:
        """Bound on convert's resident memory; it does not grow with the number of layers or experts.

        Per expert in flight (2 per worker): its source bytes, plus float32 working copies of one
        projection (about 8 arrays of the projection's size while quantising), plus the record.
        The backbone is copied in chunks of CHUNK_BYTES (source chunk, float32 and bf16 copies).
        """
        rows, cols = projection_shape("gate", self.hidden, self.intermediate)
        n = rows * cols
        source = int(3 * n * self.source_format["expert_bytes_per_weight"])
        per_expert = source + 8 * 4 * n + max(self.record_bytes(q) for q in HEADER_QUANTS)
        return BASELINE_RAM + 2 * workers * per_expert + 4 * CHUNK_BYTES


def _generation_config(ckpt: Checkpoint) -> dict | None:
    path = ckpt.directory / "generation_config.json"
    try:
        value = json.loads(path.read_bytes()) if path.is_file() else None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def tensor_role(architecture: Architecture, name: str, num_layers: int) -> Role:
    """What a tensor is. Layers stored past num_hidden_layers are MTP / next-n layers (DeepSeek-V3's layer
    61, GLM-4.5's 46), whatever the family: an optional part, like Qwen3.5's `mtp.*`."""
    m = _LAYER.match(architecture.backbone_name(name))
    if m and int(m[1]) >= num_layers:
        return Role("drop", part="mtp")
    return architecture.role(name)


def make_plan(ckpt: Checkpoint, keep: frozenset[str] = frozenset()) -> Plan:
    """Map every tensor of the checkpoint; problems are collected, not raised (probe lists them all).

    keep: optional parts (architectures.OPTIONAL_PARTS: "mtp", "vision") to put in the backbone instead
    of leaving them out.

    Raises:
        UnsupportedModel: the model_type has no entry in the architecture table.
    """
    architecture = architecture_for(ckpt.config)
    try:
        arch = architecture.arch_block(ckpt.config, _generation_config(ckpt))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as e:
        # the family's fields read from a config.json that does not hold them as that family writes them
        what = f"missing {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise UnsupportedModel(f"config.json is not a well-formed {architecture.model_type} config ({what})") from None
    qcfg = ckpt.config.get("quantization_config") or {}
    if not isinstance(qcfg, dict):
        raise UnsupportedModel("config.json: quantization_config is not an object")
    plan = Plan(architecture, arch, {"files": len(ckpt.files), "quant_method": qcfg.get("quant_method")})
    problems = plan.problems
    int4 = qcfg.get("quant_method") == "compressed-tensors"
    if int4:
        if problem := int4_source.scheme_problem(qcfg):
            problems.append(problem)
    elif qcfg and qcfg.get("quant_method") not in ("fp8", "mxfp4"):
        problems.append(f"quantization_config.quant_method {qcfg.get('quant_method')!r} is not supported "
                        "(only block-FP8 'fp8', compressed-tensors pack-quantized int4, MXFP4 'mxfp4' and "
                        "unquantised checkpoints)")
    if qcfg.get("quant_method") == "fp8" and qcfg.get("fmt", "e4m3") != "e4m3":
        problems.append(f"FP8 format {qcfg.get('fmt')!r} is not supported (only e4m3)")
    fp8_block = qcfg.get("weight_block_size") if qcfg.get("quant_method") == "fp8" else None

    # A packed int4 tensor plays the part of the `.weight` it stands for; its scale and shape go with it.
    packed_parts = {name for name in ckpt.tensors if int4 and name.endswith((int4_source.SCALE, int4_source.SHAPE))
                    and name.rsplit(".", 1)[0] + int4_source.PACKED in ckpt.tensors}
    roles = {name: tensor_role(architecture, int4_source.weight_name(name), arch["num_hidden_layers"])
             for name in ckpt.tensors if name not in packed_parts}
    # A kept part goes into the backbone whole (its experts too), its FP8 scales still read as scales.
    roles = {name: (Role("scale") if name.endswith("_scale_inv") else Role("backbone"))
             if r.kind == "drop" and r.part in keep else r for name, r in roles.items()}
    moe = set(plan.moe_layers)
    n_experts, hidden, inter = arch["num_experts"], plan.hidden, plan.intermediate
    per_expert: dict[tuple[int, int], dict[str, ProjectionSource]] = {}
    expert_dtypes, scale_dtypes, layouts = set(), set(), set()

    def scale_of(name: str) -> str | None:
        if name.endswith(int4_source.PACKED):
            s = name[: -len(int4_source.PACKED)] + int4_source.SCALE
        elif name.endswith(mxfp4_source.BLOCKS):
            s = mxfp4_source.weight_name(name) + mxfp4_source.SCALES
        else:
            s = name + "_scale_inv"
        return s if s in ckpt.tensors else None

    def logical(name: str, info: TensorInfo) -> tuple[str, tuple[int, ...]]:
        """(dtype, shape) of the weights a tensor holds: a packed int4 tensor's, unpacked; MXFP4 blocks'."""
        if name.endswith(mxfp4_source.BLOCKS):
            shape = mxfp4_source.logical_shape(info.shape)
            scale = scale_of(name)
            if info.dtype != "U8" or shape is None:
                problems.append(f"{name}: MXFP4 blocks must be U8 [E, rows, cols / 32, 16]")
                return MXFP4_DTYPE, ()
            if scale is None or ckpt.tensors[scale].dtype != "U8" or ckpt.tensors[scale].shape != info.shape[:-1]:
                problems.append(f"{name}: no U8 {mxfp4_source.SCALES} of shape {list(info.shape[:-1])}")
            return MXFP4_DTYPE, shape
        if not name.endswith(int4_source.PACKED):
            return info.dtype, info.shape
        if info.dtype != "I32" or len(info.shape) != 2:
            problems.append(f"{name}: packed int4 weights must be I32 [rows, cols / 8]")
            return INT4_DTYPE, ()
        rows, cols = info.shape[0], info.shape[1] * int4_source.CODES_PER_WORD
        scale = scale_of(name)
        if scale is None or ckpt.tensors[scale].shape != (rows, cols // int4_source.GROUP) or \
                ckpt.tensors[scale].dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: no float {int4_source.SCALE} of shape [{rows}, {cols // int4_source.GROUP}]")
        return INT4_DTYPE, (rows, cols)

    biases: dict[tuple[int, str], str] = {}  # (layer, gate_up | down) -> bias tensor
    for name, role in roles.items():
        info = ckpt.tensors[name]
        if role.kind == "scale" and name.endswith(mxfp4_source.SCALES):
            continue  # checked with its blocks
        if role.kind == "expert_bias":
            biases[(role.layer, role.projection)] = name
            continue
        if role.kind == "scale":
            weight = name[: -len("_scale_inv")]
            if weight not in ckpt.tensors:
                problems.append(f"{name}: scale without its weight")
            if info.dtype not in SCALE_DTYPES:
                problems.append(f"{name}: FP8 scale dtype {info.dtype} is not supported")
            continue
        if role.kind == "backbone":
            continue
        if role.kind == "drop":
            plan.dropped[name] = role.part
            continue
        if role.layer not in moe:
            problems.append(f"{name}: routed experts in layer {role.layer}, which the config says is "
                            f"{'dense' if role.layer < arch['num_hidden_layers'] else 'not a layer'}")
            continue
        dtype, shape = logical(name, info)
        expert_dtypes.add(dtype)
        if (scale := scale_of(name)) and dtype == FP8_DTYPE:
            scale_dtypes.add(ckpt.tensors[scale].dtype)
        if role.kind == "expert":
            layouts.add("per-expert")
            want = projection_shape(role.projection, hidden, inter)
            if shape != want:
                problems.append(f"{name}: shape {list(shape)}, config gives {list(want)}")
                continue
            per_expert.setdefault((role.layer, role.expert), {})[role.projection] = ProjectionSource(name, (), scale)
        else:
            layouts.add("fused")
            interleaved = role.fused == "interleaved"
            if dtype in (FP8_DTYPE, INT4_DTYPE) or (dtype == MXFP4_DTYPE and not interleaved):
                problems.append(f"{name}: fused {dtype} expert tensors are not supported")
                continue
            fused_up = role.kind == "fused_gate_up"
            rows, cols = (2 * inter, hidden) if fused_up else (hidden, inter)
            transposed = interleaved and dtype != MXFP4_DTYPE  # gpt-oss's float experts: [E, in, out]
            want = (n_experts, cols, rows) if transposed else (n_experts, rows, cols)
            if shape != want:
                problems.append(f"{name}: shape {list(shape)}, config gives {list(want)}")
                continue
            scale = scale_of(name) if dtype == MXFP4_DTYPE else None
            for e in range(n_experts):
                slot = per_expert.setdefault((role.layer, e), {})
                if fused_up and interleaved:  # even rows are gate, odd rows up
                    slot["gate"] = ProjectionSource(name, (e,), scale, slice(0, None, 2), transposed)
                    slot["up"] = ProjectionSource(name, (e,), scale, slice(1, None, 2), transposed)
                elif fused_up:  # rows [0, I) are gate, [I, 2I) are up
                    slot["gate"] = ProjectionSource(name, (e, slice(0, inter)))
                    slot["up"] = ProjectionSource(name, (e, slice(inter, 2 * inter)))
                else:
                    slot["down"] = ProjectionSource(name, (e,), scale, None, transposed)

    for layer in sorted(moe):
        for e in range(n_experts):
            got = per_expert.get((layer, e), {})
            missing = [p for p in PROJECTIONS if p not in got]
            if missing:
                problems.append(f"layer {layer} expert {e}: missing {', '.join(missing)} projection")
    plan.experts = {k: per_expert[k] for k in sorted(per_expert) if len(per_expert[k]) == 3}
    if biases:
        _attach_biases(plan, ckpt, biases, problems)

    bad_dtypes = expert_dtypes - set(FLOAT_DTYPES) - {FP8_DTYPE, INT4_DTYPE, MXFP4_DTYPE}
    if bad_dtypes:
        problems.append(f"expert dtype {', '.join(sorted(bad_dtypes))} is not supported")
    if len(expert_dtypes) > 1:
        problems.append(f"experts mix dtypes {', '.join(sorted(expert_dtypes))}")
    if len(scale_dtypes) > 1:
        problems.append(f"FP8 scales mix dtypes {', '.join(sorted(scale_dtypes))}")
    expert_dtype = next(iter(expert_dtypes), "BF16")
    if expert_dtype == FP8_DTYPE and fp8_block is None:
        problems.append("FP8 expert weights without a quantization_config.weight_block_size")
    plan.source_format.update({
        "expert_layout": "+".join(sorted(layouts)) or "none",
        "expert_dtype": expert_dtype,
        "expert_bytes_per_weight": {"F32": 4, FP8_DTYPE: 1, INT4_DTYPE: 0.5 + 2 / int4_source.GROUP,
                                    MXFP4_DTYPE: 0.5 + 1 / 32}.get(expert_dtype, 2),
        "fp8_block": fp8_block,
        "fp8_scale_dtype": next(iter(scale_dtypes), None),
    })

    for name, role in roles.items():
        if role.kind != "backbone":
            continue
        info = ckpt.tensors[name]
        if name.endswith(int4_source.PACKED):  # dequantised to bf16 at convert
            dtype, shape = logical(name, info)
            if shape:
                plan.backbone.append(BackboneTensor(architecture.backbone_name(int4_source.weight_name(name)), "BF16",
                                                    shape, info, scale_of(name)))
        elif info.dtype in FLOAT_DTYPES or info.dtype == FP8_DTYPE:
            scale = scale_of(name) if info.dtype == FP8_DTYPE else None
            if info.dtype == FP8_DTYPE and (scale is None or len(info.shape) != 2 or fp8_block is None):
                problems.append(f"{name}: FP8 tensor without a usable block scale")
                continue
            # Vectors stored in F32 (router score biases, DeltaNet decay and norm) stay F32: they are tiny,
            # and a correction bias rounded to bf16 would change which experts are chosen.
            dtype = "F32" if info.dtype == "F32" and len(info.shape) == 1 else "BF16"
            plan.backbone.append(BackboneTensor(architecture.backbone_name(name), dtype, info.shape, info, scale))
        elif info.dtype in ("I64", "I32"):
            plan.backbone.append(BackboneTensor(architecture.backbone_name(name), info.dtype, info.shape, info))
        else:
            problems.append(f"{name}: backbone dtype {info.dtype} is not supported")
    plan.backbone.sort(key=lambda t: t.name)
    if not moe:
        problems.append("the config names no MoE layer: nothing to put in a vault")
    return plan


def _attach_biases(plan: Plan, ckpt: Checkpoint, biases: dict[tuple[int, str], str], problems: list[str]) -> None:
    """Give every expert's projections their bias tensors (fused [E, 2I] gate_up with interleaved rows, and
    [E, H] down); a vault holds biases for all experts or none."""
    n_experts, inter = plan.arch["num_experts"], plan.intermediate
    want = {"gate_up": (n_experts, 2 * inter), "down": (n_experts, plan.hidden)}
    for (layer, proj), name in sorted(biases.items()):
        info = ckpt.tensors[name]
        if info.shape != want[proj] or info.dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: expert bias {info.dtype} {list(info.shape)}, config gives float {list(want[proj])}")
    missing = [f"layer {layer} {proj}" for layer in plan.moe_layers for proj in want if (layer, proj) not in biases]
    if missing:
        problems.append(f"expert biases missing for {', '.join(missing)} (a vault holds them for every expert or none)")
        return
    for (layer, _), sources in plan.experts.items():
        for p in ("gate", "up", "down"):
            src = sources[p]
            sources[p] = ProjectionSource(src.tensor, src.index, src.scale, src.rows, src.transposed,
                                          biases[(layer, "down" if p == "down" else "gate_up")])
    plan.expert_bias = True
