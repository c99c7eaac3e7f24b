"""`mosaic-shatter probe | convert | verify`: parse, call, print. Exit codes: 0 ok, 1 failed, 2 refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mosaic_runtime.backbone import BACKBONE_MODES, resident_bytes
from mosaic_runtime.kv_cache import KV_DTYPES, KVCache, WindowCache, windowed_layers
from mosaic_runtime.model_store import models_dir, store_name
from mosaic_runtime.recipe import read_recipe
from mosaic_runtime.vault.format import LOW_BIT_NAMES, QUANT_NAMES, VaultError

from .architectures import OPTIONAL_PARTS, UnsupportedModel
from .checkpoint import DTYPE_BYTES, Checkpoint, CheckpointError
from .convert import ConvertError, ConvertInterrupted, convert, default_workers, needed_disk_bytes
from .plan import INT4_DTYPE, MXFP4_DTYPE, Plan, make_plan
from .precision import HOT_MASS, MixedPrecision, PrecisionError


def _fail(message: str, code: int = 2):
    click.echo(f"mosaic-shatter: {message}", err=True)
    sys.exit(code)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def probe_report(ckpt: Checkpoint, plan: Plan) -> dict:
    """Everything probe says, as one JSON-ready object."""
    arch, fmt = plan.arch, plan.source_format
    kinds = arch["layer_kinds"]
    return {
        "source": ckpt.source_label,
        "model_type": arch["model_type"],
        "num_layers": arch["num_hidden_layers"],
        "moe_layers": kinds.count("moe"),
        "dense_layers": kinds.count("dense"),
        "layer_kinds": kinds,
        "num_experts": arch["num_experts"],
        "top_k": arch["num_experts_per_tok"],
        "norm_topk_prob": arch["norm_topk_prob"],
        "shared_expert_intermediate_size": arch["shared_expert_intermediate_size"],
        "hidden_size": arch["hidden_size"],
        "moe_intermediate_size": arch["moe_intermediate_size"],
        "attention": {k: arch.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                               "latent_attention")},
        "rope": arch["rope"],
        "source_format": {k: v for k, v in fmt.items() if k != "expert_bytes_per_weight"},
        "expert_source_bytes": int(3 * plan.hidden * plan.intermediate * fmt["expert_bytes_per_weight"]),
        "record_bytes": {name: plan.record_bytes(q) for name, q in QUANT_NAMES.items()},
        "num_records": len(plan.experts),
        "vault_bytes": {name: plan.vault_bytes(q) for name, q in QUANT_NAMES.items()},
        "backbone_bytes": plan.backbone_bytes,
        "backbone_tensors": len(plan.backbone),
        "resident_bytes": {mode: resident_bytes({t.name: (t.shape, DTYPE_BYTES[t.dtype]) for t in plan.backbone},
                                                mode, arch["tie_word_embeddings"]) for mode in BACKBONE_MODES},
        "kv_bytes_per_1k_tokens": kv_bytes_per_1k_tokens(arch),
        "kv_window_bytes": kv_window_bytes(arch),
        "fp8_passthrough": plan.fp8_passthrough(),
        "peak_ram_bytes": plan.peak_ram_bytes(default_workers(plan)),
        "disk_bytes": {name: needed_disk_bytes(ckpt, plan, q) for name, q in QUANT_NAMES.items()},
        "layer_types": arch.get("layer_types"),
        "left_out": left_out(plan),
        "problems": plan.problems,
    }


LONG_CONTEXT = 1 << 20  # a max_seq long enough for every window ring to pay


def kv_bytes_per_1k_tokens(arch: dict) -> dict[str, int] | None:
    """The KV cache 1024 tokens take at each cache dtype the runtime offers (a latent cache for latent
    attention), at a long context (sliding-window layers held in their fixed ring, kv_window_bytes); None
    when the runtime cannot read the arch block."""
    try:
        recipe = read_recipe(arch)
    except NotImplementedError:
        return None
    if recipe.attention is None:
        return {name: 0 for name in KV_DTYPES}
    heads, dim, shared = recipe.attention.cache_geometry
    growing = len(recipe.attention_layers) - len(windowed_layers(recipe, LONG_CONTEXT))
    return {name: KVCache.bytes_for(growing, 1024, heads, dim, dtype.itemsize, shared=shared)
            for name, dtype in KV_DTYPES.items()}


def kv_window_bytes(arch: dict) -> dict[str, int] | None:
    """What the sliding-window layers' rings hold at a long context, whatever its length, at each cache
    dtype; None when the model has none (or the runtime cannot read the arch block)."""
    try:
        recipe = read_recipe(arch)
    except NotImplementedError:
        return None
    windowed = windowed_layers(recipe, LONG_CONTEXT)
    if not windowed:
        return None
    heads, dim, _ = recipe.attention.cache_geometry
    window = recipe.layers[windowed[0]].mixer.sliding_window
    return {name: WindowCache.bytes_for(len(windowed), window, heads, dim, dtype.itemsize)
            for name, dtype in KV_DTYPES.items()}


def left_out(plan: Plan) -> dict[str, int]:
    """Tensors left out of the backbone, counted by part label: {"vision tower": n, "MTP head": n}."""
    parts: dict[str, int] = {}
    for part in plan.dropped.values():
        label = OPTIONAL_PARTS.get(part, "other")
        parts[label] = parts.get(label, 0) + 1
    return parts


def _print_probe(r: dict) -> None:
    fmt, att = r["source_format"], r["attention"]
    echo = click.echo
    echo(f"{r['source']}")
    echo(f"  model_type      {r['model_type']}")
    echo(f"  source          {fmt['files']} safetensors file(s), experts {fmt['expert_dtype']} "
         f"({fmt['expert_layout']})" + (f", FP8 blocks {fmt['fp8_block']} scales {fmt['fp8_scale_dtype']}"
                                        if fmt["fp8_block"] else ""))
    types = r["layer_types"] or []
    mixers = (f"; {types.count('linear_attention')} linear-attention (Gated DeltaNet), "
              f"{types.count('full_attention')} full-attention" if "linear_attention" in types else "")
    echo(f"  layers          {r['num_layers']} ({r['moe_layers']} MoE, {r['dense_layers']} dense{mixers})")
    echo(f"  experts         {r['num_experts']} per MoE layer, top-{r['top_k']}, "
         f"norm_topk_prob {str(r['norm_topk_prob']).lower()}, shared experts "
         f"{r['shared_expert_intermediate_size'] or 'none'}")
    mla = att["latent_attention"]
    heads = (f"{att['num_attention_heads']} heads of latent attention (a cached latent of {mla['kv_lora_rank']} + "
             f"{mla['qk_rope_head_dim']} a token)" if mla else
             f"{att['num_attention_heads']} heads / {att['num_key_value_heads']} kv heads x {att['head_dim']}")
    echo(f"  geometry        hidden {r['hidden_size']}, moe_intermediate {r['moe_intermediate_size']}, {heads}, "
         f"rope theta {r['rope']['theta']:g}")
    echo(f"  per expert      source {_size(r['expert_source_bytes'])}; Q4 {_size(r['record_bytes']['q4'])}; "
         f"FP8 {_size(r['record_bytes']['fp8'])}; MXFP4 {_size(r['record_bytes']['mxfp4'])}")
    echo(f"  vault           Q4 {_size(r['vault_bytes']['q4'])}, FP8 {_size(r['vault_bytes']['fp8'])}, "
         f"MXFP4 {_size(r['vault_bytes']['mxfp4'])}"
         f"{' (FP8 passes the source through bit-exactly)' if r['fp8_passthrough'] else ''}"
         f"{' (MXFP4 passes the source through bit-exactly)' if fmt['expert_dtype'] == MXFP4_DTYPE else ''}"
         f"{' (Q4 takes the source int4 codes as they are)' if fmt['expert_dtype'] == INT4_DTYPE else ''}  "
         f"[{r['num_records']} records]")
    echo(f"  backbone bf16   {_size(r['backbone_bytes'])} ({r['backbone_tensors']} tensors)")
    echo("  in memory       backbone " + ", ".join(f"{mode} {_size(n)}" for mode, n in r["resident_bytes"].items())
         + " (Engine.open backbone=)")
    if r["kv_bytes_per_1k_tokens"] is not None:
        echo("  KV cache        per 1k tokens " + ", ".join(f"{dtype} {_size(n)}" for dtype, n
                                                         in r["kv_bytes_per_1k_tokens"].items()) + " (kv_dtype=)")
    if r["kv_window_bytes"] is not None:
        echo("  window layers   fixed at any long context: " + ", ".join(
            f"{dtype} {_size(n)}" for dtype, n in r["kv_window_bytes"].items()))
    if r["left_out"]:
        echo("  left out        " + ", ".join(f"{part} ({n} tensors)" for part, n in r["left_out"].items())
             + ": text-only (--keep mtp / --keep vision keeps them)")
    echo(f"  convert needs   peak RAM ~{_size(r['peak_ram_bytes'])}; free disk Q4 {_size(r['disk_bytes']['q4'])}, "
         f"FP8 {_size(r['disk_bytes']['fp8'])}, MXFP4 {_size(r['disk_bytes']['mxfp4'])}")
    if r["problems"]:
        echo(f"  cannot convert  {len(r['problems'])} problem(s):")
        for p in r["problems"][:20]:
            echo(f"    - {p}")
        if len(r["problems"]) > 20:
            echo(f"    ... and {len(r['problems']) - 20} more")
    else:
        echo("  cannot convert  nothing: ready to convert")


def _open(source: str, revision: str | None, keep: frozenset[str]) -> tuple[Checkpoint, Plan]:
    try:
        ckpt = Checkpoint(source, revision)
        return ckpt, make_plan(ckpt, keep)
    except (CheckpointError, UnsupportedModel) as e:
        _fail(str(e))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mosaic")
def main():
    """Turn a Hugging Face MoE checkpoint into a Mosaic expert vault and bf16 backbone."""


_KEEP = click.option("--keep", multiple=True, type=click.Choice(sorted(OPTIONAL_PARTS)),
                     help="Keep an optional part (the MTP head, a vision tower) in the backbone; text-only by default.")


@main.command()
@click.argument("source")
@click.option("--revision", help="Revision, when SOURCE is a repo id in the Hub cache.")
@click.option("--json", "as_json", is_flag=True, help="Print one machine-readable JSON object.")
@_KEEP
def probe(source, revision, as_json, keep):
    """Dry run: read headers and config only, print topology, sizes and what cannot be converted."""
    ckpt, plan = _open(source, revision, frozenset(keep))
    report = probe_report(ckpt, plan)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_probe(report)


@main.command(name="convert")
@click.argument("source")
@click.option("-o", "--out", type=click.Path(),
              help="Output model directory (default: the model store, MOSAIC_HOME/models/NAME-QUANT).")
@click.option("--quant", required=True, type=click.Choice(sorted(QUANT_NAMES)), help="Expert quantisation.")
@click.option("--revision", help="Revision, when SOURCE is a repo id in the Hub cache.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (only once the new one is complete).")
@click.option("--workers", type=click.IntRange(min=1),
              help="Expert encoding threads (default: two a core, as many as half the free memory holds).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_KEEP
@click.option("--routing", type=click.Path(),
              help="Experts at their own precision (with --quant q4): the routing counts `mosaic calibrate` "
                   "measured on calibration text; each layer's cold tail is stored at --cold.")
@click.option("--cold", type=click.Choice(sorted(LOW_BIT_NAMES)), default="q3", show_default=True,
              help="With --routing: the type of the experts outside the hot mass (3.5 or 2.5 bits a weight).")
@click.option("--hot-mass", type=click.FloatRange(0.0, 1.0), default=HOT_MASS, show_default=True,
              help="With --routing: per layer, the most-routed experts carrying this share of the routing stay Q4.")
def convert_cmd(source, out, quant, revision, force, workers, quiet, keep, routing, cold, hot_mass):
    """Convert SOURCE (a checkpoint directory or a cached repo id) into OUT, or into the model store."""
    if out is None:
        out = models_dir() / store_name(source, quant)
    try:
        mixed = MixedPrecision.of(routing, cold, hot_mass) if routing else None
    except PrecisionError as e:
        _fail(str(e))
    try:
        result = convert(source, out, quant, revision=revision, workers=workers, force=force,
                         progress=not quiet, keep=frozenset(keep), mixed=mixed)
    except ConvertInterrupted as e:
        _fail(str(e), 130)
    except (CheckpointError, UnsupportedModel, ConvertError) as e:
        _fail(str(e))
    except KeyboardInterrupt:  # before the convert began writing
        _fail("interrupted; nothing was written", 130)
    click.echo(f"wrote {result.out}: {result.records} expert records, vault {_size(result.vault_bytes)}, "
               f"backbone {_size(result.backbone_bytes)} in {result.seconds:.1f} s"
               + (f" (resumed: {result.resumed_records} records were already written)" if result.resumed_records
                  else ""))
    if Path(result.out).parent == models_dir():
        click.echo(f"run it with: mosaic chat {Path(result.out).name}   (or mosaic serve)")


@main.command()
@click.argument("out", type=click.Path())
@click.option("--quiet", is_flag=True, help="No progress bar.")
def verify(out, quiet):
    """Re-read OUT and check every checksum, alignment and index entry. Exit 0 only if all is well."""
    from tqdm import tqdm

    from mosaic_runtime.vault import open_vault
    try:
        vault = open_vault(out)
    except VaultError as e:
        _fail(str(e), 1)
    with vault, tqdm(total=sum(e.length for e in vault.entries.values()), unit="B", unit_scale=True,
                     desc="verify", disable=quiet) as bar:
        problems = vault.verify(progress=bar.update)
    if problems:
        for p in problems:
            click.echo(f"FAIL {p}", err=True)
        _fail(f"{len(problems)} problem(s) in {out}", 1)
    per_record = vault.header.per_record_quant
    types = ", ".join(f"{n} {q}" for q, n in vault.record_quants.items()) if per_record else vault.quant
    click.echo(f"ok {out}: {vault.header.num_records} records ({types}), index, metadata and backbone intact")


if __name__ == "__main__":
    main()
