"""`mosaic chat MODEL_DIR`: an interactive, multi-turn chat on a converted model.

On a terminal: a prompt, streamed answers, /reset, /stats, /quit, and Ctrl-C stopping the current answer
(not the program). From a pipe: each input line is one user turn and its answer is printed as one line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from .model_store import list_models, models_dir, resolve_model
from .vault.format import VaultError

HELP = "/reset starts over, /stats shows the cache and speed, /quit leaves (Ctrl-C stops an answer)"


def parse_size(text: str | None) -> int | None:
    """'8G', '512M', '1.5GiB' or a byte count -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise click.BadParameter(f"{text!r} is not a size such as 8G or 512M")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def format_stats(engine) -> str:
    s = engine.stats
    layers = ", ".join(f"{layer}: {s.hits[layer]}/{s.misses[layer]}" for layer in s.hits)
    ring = ""
    if engine.store is not None:
        policy, valve = engine.store.policy, engine.valve
        ring = f"ring {policy.usable} of {engine.vault.header.num_records} experts"
        if valve is not None and valve.counters.given_back:
            ring += (f" ({valve.counters.given_back} slots given back under memory pressure since open, "
                     f"{valve.counters.taken_back} taken again)")
        ring += ", "
    how = ", ".join(f"{k} {v}" for k, v in engine.settings.items())
    if engine.memory_limit is not None:
        how += f"\nmemory at open: {engine.memory_limit.available / 2**30:.2f} GiB free, bounded by {engine.memory_limit.bound}"
    return (f"{how}\nlast answer: {s.prompt_tokens} prompt tokens prefilled, {s.new_tokens} generated, "
            f"TTFT {s.ttft_s * 1e3:.0f} ms, {s.tok_per_s:.1f} tok/s\n"
            f"{ring}hit rate {s.hit_rate:.2f}, {s.bytes_read / 2**20:.1f} MiB read since start; "
            f"time in I/O wait {s.io_s:.2f} s, expert kernel {s.kernel_s:.2f} s, backbone {s.backbone_s:.2f} s\n"
            f"cache hits/misses per layer: {layers or '-'}")


def run_turn(conversation, text: str, sampling: dict, out) -> bool:
    """Stream one answer to out; False if Ctrl-C stopped it."""
    answer = conversation.ask(text, **sampling)
    try:
        for piece in answer:
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        answer.close()
        out.write(" [stopped]")
        return False
    finally:
        out.write("\n")
        out.flush()
    return True


@click.group()
def main() -> None:
    """Mosaic: run Mixture-of-Experts models from an expert vault."""


@main.command()
@click.argument("model")
@click.option("--system", help="system message that opens the conversation")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0 is greedy")
@click.option("--top-p", type=float, default=0.9, show_default=True)
@click.option("--max-tokens", type=int, default=256, show_default=True, help="longest answer")
@click.option("--ram-budget", help="bytes for the expert ring, such as 8G (default: from available memory)")
@click.option("--io", type=click.Choice(["direct", "buffered"]), help="expert reads (default: buffered)")
@click.option("--max-seq", type=int, default=4096, show_default=True, help="longest conversation, in tokens")
@click.option("--seed", type=int, default=None, help="seed for sampling")
@click.option("--exact", is_flag=True,
              help="float kernels on the backbone as stored (the reference) instead of the fast default: Q4 experts "
                   "and a Q4 backbone against int8 activations where the CPU has AVX2 or AVX-512")
@click.option("--backbone", type=click.Choice(["bf16", "int8", "fp8", "q4"]),
              help="backbone precision (default: q4 with AVX2 or AVX-512, else int8; bf16 with --exact): as stored, or "
                   "its projections quantised at load")
@click.option("--kernel", type=click.Choice(["native", "native-int8", "torch"]),
              help="expert kernel (default: native-int8 where the CPU has AVX2 or AVX-512, else native; native with "
                   "--exact); torch is the slow reference")
@click.option("--kv-dtype", type=click.Choice(["float32", "bfloat16", "int8"]), default="float32", show_default=True,
              help="what the KV cache holds: bfloat16 and int8 take a half and a quarter of the memory")
@click.option("--threads", type=int, help="threads for the kernels (default: every core)")
@click.option("--show-analysis", is_flag=True,
              help="models that answer in harmony's channels (gpt-oss): show the analysis channel (the reasoning) "
                   "before the final answer")
def chat(model, system, temperature, top_p, max_tokens, ram_budget, io, max_seq, seed, exact, backbone, kernel,
         kv_dtype, threads, show_analysis) -> None:
    """Chat with MODEL: a directory written by `mosaic-shatter convert`, or a name in the store (`mosaic list`)."""
    from .chat import Conversation
    from .engine import Engine

    try:
        model = resolve_model(model)
    except LookupError as e:
        click.echo(f"mosaic: {e}", err=True)
        sys.exit(2)
    try:
        engine = Engine.open(model, ram_budget=parse_size(ram_budget), io=io, threads=threads, max_seq=max_seq,
                             precision="exact" if exact else "fast", kernel=kernel, backbone=backbone,
                             kv_dtype=kv_dtype, verbose=True)
        conversation = Conversation(engine, system, show_analysis)
    except (VaultError, ValueError, NotImplementedError) as e:
        click.echo(f"mosaic: {e}", err=True)
        sys.exit(1)
    sampling = dict(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        click.echo(f"{model.name}: {engine.arch['model_type']}, {engine.vault.quant}. {HELP}")
        if engine.store is not None and engine.memory_limit is not None:
            click.echo(f"ring: {engine.store.ring.n_slots} of {engine.vault.header.num_records} experts; memory bounded "
                       f"by {engine.memory_limit.bound}")
    with engine:
        while True:
            try:
                line = input(">>> ") if interactive else sys.stdin.readline()
            except KeyboardInterrupt:
                click.echo()
                continue
            except EOFError:
                line = ""
                if interactive:
                    click.echo()
                break
            if not interactive and not line:
                break  # end of the pipe
            text = line.strip()
            if not text:
                continue
            if text == "/quit":
                break
            if text == "/reset":
                conversation.reset()
                click.echo("(conversation reset)")
                continue
            if text == "/stats":
                click.echo(format_stats(engine))
                continue
            if text.startswith("/"):
                click.echo(HELP)
                continue
            if seed is not None:  # one seed per turn: reproducible, without every answer starting alike
                sampling["seed"] = seed + sum(m["role"] == "user" for m in conversation.messages)
            try:
                run_turn(conversation, text, sampling, sys.stdout)
            except VaultError as e:  # a record that fails its check: the vault is damaged, not the turn
                click.echo(f"mosaic: {e}; check the whole vault with: mosaic-shatter verify {model}", err=True)
                sys.exit(1)
            except ValueError as e:  # the conversation outgrew max_seq, or the chat template failed on it
                click.echo(f"mosaic: {e}; /reset to start over", err=True)


@main.command()
@click.argument("model")
@click.argument("text", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", required=True, type=click.Path(dir_okay=False), help="the routing counts file to write")
@click.option("--window", type=int, default=512, show_default=True, help="tokens a forward pass, teacher-forced")
@click.option("--max-tokens", type=int, help="stop after this many tokens of the text")
def calibrate(model, text, out, window, max_tokens) -> None:
    """Count how often MODEL's router picks each expert over calibration TEXT files, for
    `mosaic-shatter convert --routing OUT` (experts at their own precision)."""
    from .calibrate import routing_counts, write_routing
    from .engine import Engine

    try:
        model = resolve_model(model)
        if window < 1 or (max_tokens is not None and max_tokens < 1):
            raise ValueError("--window and --max-tokens must be at least 1")
        with Engine.open(model, max_seq=window, precision="exact") as engine:
            if engine.codec is None:
                raise ValueError(f"{model} has no tokenizer to read the calibration text with")
            ids = [i for path in text for i in engine.codec.encode(Path(path).read_text(encoding="utf-8"))]
            ids = ids[:max_tokens] if max_tokens else ids
            if not ids:
                raise ValueError("the calibration text holds no tokens")
            counts = routing_counts(engine, ids, window)
            write_routing(out, engine, counts, len(ids), list(text))
    except LookupError as e:
        click.echo(f"mosaic: {e}", err=True)
        sys.exit(2)
    except (VaultError, ValueError, OSError, NotImplementedError) as e:
        click.echo(f"mosaic: {e}", err=True)
        sys.exit(1)
    click.echo(f"wrote {out}: routing of {len(ids):,} tokens over {len(counts)} MoE layers")


@main.command(name="list")
def list_cmd() -> None:
    """The model store (MOSAIC_HOME, default ~/.cache/mosaic): what `mosaic chat NAME` and `mosaic serve` find."""
    models = list_models()
    if not models:
        click.echo(f"the store ({models_dir()}) is empty; convert a model into it with: "
                   "mosaic-shatter convert SOURCE --quant q4")
        return
    rows = [("NAME", "FAMILY", "QUANT", "VAULT", "BACKBONE", "SOURCE")]
    rows += [(m.name, m.model_type, m.quant, f"{m.vault_bytes / 2**30:.2f} GiB", f"{m.backbone_bytes / 2**30:.2f} GiB",
              m.source) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


@main.command()
@click.argument("models", nargs=-1)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (loopback by default)")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="MOSAIC_API_KEY", help="require this key (Authorization: Bearer or x-api-key); "
              "also from MOSAIC_API_KEY")
@click.option("--max-seq", type=int, default=8192, show_default=True,
              help="context in tokens; a longer prompt is refused with a 400")
@click.option("--ram-budget", help="bytes for the expert ring, such as 8G (default: from available memory)")
@click.option("--io", type=click.Choice(["direct", "buffered"]), help="expert reads (default: buffered)")
@click.option("--exact", is_flag=True, help="float kernels on the backbone as stored instead of the fast default")
@click.option("--kv-dtype", type=click.Choice(["float32", "bfloat16", "int8"]), default="float32", show_default=True,
              help="what the KV cache holds: bfloat16 and int8 take a half and a quarter of the memory")
@click.option("--threads", type=int, help="threads for the kernels (default: every core)")
@click.option("--prompt-cache/--no-prompt-cache", default=True, show_default=True,
              help="prefill only what a request adds to the conversation the engine holds")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info", show_default=True)
def serve(models, host, port, api_key, max_seq, ram_budget, io, exact, kv_dtype, threads, prompt_cache,
          log_level) -> None:
    """Serve MODELS (directories or store names; default: the whole store) over the OpenAI and Anthropic
    protocols, with a web chat at http://HOST:PORT/."""
    try:
        from .serve.main import run_server
    except ImportError as e:
        click.echo(f"mosaic: serve needs its extra ({e.name} is missing): pip install 'mosaic[serve]'", err=True)
        sys.exit(2)
    sys.exit(run_server(list(models), host=host, port=port, api_key=api_key, max_seq=max_seq,
                        ram_budget=parse_size(ram_budget), io=io, exact=exact, kv_dtype=kv_dtype, threads=threads,
                        prompt_cache=prompt_cache, log_level=log_level))


if __name__ == "__main__":
    main()
