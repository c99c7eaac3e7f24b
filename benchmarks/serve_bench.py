"""Time to first token of a conversation's second turn through HTTP, with and without the prompt cache.

    python benchmarks/serve_bench.py [--model DIR ...] [--system-words 1500] [--rounds 3]

For each model (default: the bundled model, converted to Q4 in a temporary directory) a `mosaic serve`
process runs with the prompt cache, then one with --no-prompt-cache. Each round is a new conversation (a long
system prompt that differs per round, a question, a greedy 16-token answer, a follow-up question): the
second turn's TTFT is timed from the request to its first content chunk, streamed, as a client sees it.
Prints one JSON line per turn and a table of medians.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from serving import BUNDLED, ServerProcess  # noqa: E402

WORDS = ("the value of a list key path file name string object return module class function default error "
         "time data buffer stream socket thread lock queue event handler config option parser token").split()


def system_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return f"Session {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def stream_turn(url: str, messages: list[dict], max_tokens: int) -> dict:
    """TTFT (to the first content chunk), the answer, and the usage of one streamed chat turn."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    res = conn.getresponse()
    assert res.status == 200, res.read()
    ttft, text, usage = None, [], None
    for line in res:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if (choice["delta"].get("content") or choice["finish_reason"]) and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(choice["delta"].get("content") or "")
    conn.close()
    return {"ttft_s": ttft, "answer": "".join(text), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def run_model(model: Path, args, home: Path) -> list[dict]:
    rows = []
    for cache in (True, False):
        flags = [str(model), "--max-seq", str(args.max_seq)] + ([] if cache else ["--no-prompt-cache"])
        server = ServerProcess(flags, home)
        try:
            stream_turn(server.url, [{"role": "user", "content": "warm up"}], 4)
            for r in range(args.rounds):
                messages = [{"role": "system", "content": system_prompt(args.system_words, r)},
                            {"role": "user", "content": "What does json.dumps do?"}]
                first = stream_turn(server.url, messages, 16)
                messages += [{"role": "assistant", "content": first["answer"]},
                             {"role": "user", "content": "And json.loads?"}]
                second = stream_turn(server.url, messages, 16)
                for turn, out in ((1, first), (2, second)):
                    row = {"model": model.name, "prompt_cache": cache, "round": r, "turn": turn,
                           **{k: v for k, v in out.items() if k != "answer"}}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", type=Path, help="model directory (repeatable)")
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seq", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = args.model
        if not models:
            from mosaic_shatter.convert import convert
            models = [convert(str(BUNDLED), Path(tmp) / "stdlib-q4", "q4", progress=False).out]
        rows = [row for m in models for row in run_model(m, args, Path(tmp) / "home")]
    print("\n| model | turn-2 prompt tokens | cached | TTFT with cache | TTFT without | ratio |\n|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["model"] for r in rows):
        turn2 = [r for r in rows if r["model"] == name and r["turn"] == 2]
        on = [r for r in turn2 if r["prompt_cache"]]
        off = [r for r in turn2 if not r["prompt_cache"]]
        t_on, t_off = statistics.median(r["ttft_s"] for r in on), statistics.median(r["ttft_s"] for r in off)
        print(f"| {name} | {on[0]['prompt_tokens']} | {statistics.median(r['cached_tokens'] for r in on):.0f} | "
              f"{t_on * 1e3:.0f} ms | {t_off * 1e3:.0f} ms | {t_off / t_on:.1f}x |")


if __name__ == "__main__":
    main()
