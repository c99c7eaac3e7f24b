"""The README's main command: shatter the bundled model and run it.

The bundled model (examples/stdlib-moe, see its MODEL_CARD.md) is a small Qwen3-MoE trained here on the
Python standard library. This script probes it, converts it to a Q4 and an FP8 vault, verifies both, and
runs the Q4 one with a ring holding a quarter of its experts: a code completion and a scripted chat turn,
with tok/s and the expert cache's statistics. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "stdlib-moe"
OUT = HERE.parent / "demo"


def shatter(*args: str) -> None:
    print("\n$ mosaic-shatter " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "mosaic_shatter.cli", *args], check=True)


def report(engine) -> None:
    s = engine.stats
    print(f"  [{s.prompt_tokens} prompt tokens, {s.new_tokens} generated; TTFT {s.ttft_s * 1e3:.0f} ms, "
          f"{s.tok_per_s:.1f} tok/s; ring {engine.store.ring.n_slots} of {engine.vault.header.num_records} "
          f"experts, hit rate {s.hit_rate:.2f}, {s.bytes_read / 2**20:.1f} MiB read so far]")


def main() -> None:
    shatter("probe", str(MODEL))
    for quant in ("q4", "fp8"):
        out = OUT / f"stdlib-moe-{quant}"
        shutil.rmtree(out, ignore_errors=True)
        t = time.monotonic()
        shatter("convert", str(MODEL), "-o", str(out), "--quant", quant, "--quiet")
        print(f"  ({time.monotonic() - t:.1f} s)")
        shatter("verify", str(out), "--quiet")

    from mosaic_runtime import Engine, open_vault
    from mosaic_runtime.chat import Conversation
    q4 = OUT / "stdlib-moe-q4"
    with open_vault(q4) as vault:
        budget = vault.header.num_records * vault.header.record_bytes // 4
    with Engine.open(q4, ram_budget=budget, max_seq=1024) as engine:
        prompt = "import os\n\n\ndef walk_files(root):\n    \"\"\""
        print(f"\n--- completion (temperature 0.6, seed 0) of {prompt!r}")
        print(prompt + "".join(engine.generate(prompt, max_new_tokens=64, temperature=0.6, top_p=0.9, seed=0)))
        report(engine)

        chat = Conversation(engine)
        for question in ("What does `json.dumps` do?", "What does `os.walk` do?"):
            print(f"\n--- chat\n>>> {question}")
            print("".join(chat.ask(question, max_new_tokens=64, temperature=0.6, top_p=0.9, seed=0)))
            report(engine)
        s = engine.stats
        print("\nexpert cache hits/misses per layer since start: "
              + ", ".join(f"{layer}: {s.hits[layer]}/{s.misses[layer]}" for layer in s.hits))
    mosaic = Path(sys.executable).with_name("mosaic")
    print(f"\nChat with it yourself: {mosaic if mosaic.exists() else 'mosaic'} chat {q4}")


if __name__ == "__main__":
    main()
