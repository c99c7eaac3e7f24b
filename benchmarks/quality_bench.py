"""Held-out perplexity of the bundled model: the transformers model (bf16 weights, float32 compute)
against Mosaic on its FP8 and Q4 vaults, exact and at the fast default (and each fast setting alone), on the
same windows of held-out standard-library text, with top-1 agreement against transformers and against
Mosaic's exact Q4 run.

    python benchmarks/quality_bench.py [--model examples/stdlib-moe] [--windows 40]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
from train_bundled import SEQ, chat_turns, held_out, stdlib_files  # noqa: E402

from mosaic_runtime.engine import Engine  # noqa: E402
from mosaic_shatter.convert import convert  # noqa: E402


def windows(tokenizer_dir: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for rel, text in stdlib_files():
        if held_out(rel):
            for doc in [text] + chat_turns(rel, text):
                ids += tok.encode(doc).ids + [eot]
    return [ids[i * SEQ:(i + 1) * SEQ] for i in range(min(n, len(ids) // SEQ))]


def score(logits_of, wins) -> tuple[float, list[torch.Tensor]]:
    """(perplexity over every next-token prediction of the windows, the argmax per window)."""
    nll, count, tops = 0.0, 0, []
    for w in wins:
        logits = logits_of(w)
        target = torch.tensor(w[1:])
        nll += F.cross_entropy(logits[:-1].double(), target, reduction="sum").item()
        count += len(w) - 1
        tops.append(logits[:-1].argmax(-1))
    return math.exp(nll / count), tops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--windows", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    wins = windows(args.model, args.windows)
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with torch.inference_mode():
        ppl_ref, top_ref = score(lambda w: ref(torch.tensor([w])).logits[0].float(), wins)
    def agreement(a, b) -> float:
        return sum((x == y).sum().item() for x, y in zip(a, b)) / sum(len(t) for t in a)

    rows = [("transformers, bf16 weights, float32 compute", ppl_ref, 1.0, None)]
    exact_tops = None
    with tempfile.TemporaryDirectory() as tmp:
        for quant, settings in (("fp8", dict(precision="exact")), ("q4", dict(precision="exact")),
                                ("q4", dict()),  # the default: precision="fast"
                                ("q4", dict(precision="exact", kernel="native-int8")),
                                ("q4", dict(precision="exact", backbone="int8")),
                                ("q4", dict(precision="exact", backbone="fp8")),
                                ("q4", dict(backbone="q4"))):
            out = Path(tmp) / quant
            if not out.exists():
                convert(str(args.model), out, quant, progress=False)
            with Engine.open(out, max_seq=SEQ, **settings) as engine:
                ppl, tops = score(engine.logits, wins)
                how = ", ".join(f"{k}={v}" for k, v in engine.settings.items() if k != "kv_dtype")
            if quant == "q4" and settings == dict(precision="exact"):
                exact_tops = tops
            rows.append((f"Mosaic {quant.upper()} vault, {how}" + (" (the default)" if not settings else ""), ppl,
                         agreement(tops, top_ref), agreement(tops, exact_tops) if exact_tops else None))
    print(f"{len(wins)} held-out windows of {SEQ} tokens ({len(wins) * (SEQ - 1):,} predictions)\n")
    print("| model | held-out perplexity | vs transformers | top-1 agreement with transformers | "
          "with Mosaic Q4 exact |")
    print("|---|---|---|---|---|")
    for name, ppl, agree, agree_exact in rows:
        print(f"| {name} | {ppl:.3f} | {ppl / ppl_ref - 1:+.2%} | {agree:.4f} | "
              f"{'-' if agree_exact is None else f'{agree_exact:.4f}'} |")


if __name__ == "__main__":
    main()
