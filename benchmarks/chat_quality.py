"""Does the bundled model answer what it was trained to answer? Chat turns on held-in docstring questions,
and held-out perplexity, through Mosaic as a user runs it.

    python benchmarks/chat_quality.py [--model examples/stdlib-moe] [--questions 200] [--held-out]

The model is converted to a Q4 vault and run with the default (fast) precision, greedy, as `mosaic chat
--temperature 0` would. Questions are the training script's own chat turns ("What does `json.dumps` do?")
from files of the training split (with --held-out: of the held-out split, never taught), a seeded sample. An
answer counts when it starts with the first sentence of the docstring's first paragraph, or holds most (over
half) of that sentence's words among its own first words (as many, plus five). Perplexity: exact precision,
over the first windows of the held-out split.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import re
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def training_script():
    spec = importlib.util.spec_from_file_location("train_bundled", ROOT / "examples" / "train_bundled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def questions(train, n: int, seed: int = 0, held_out: bool = False) -> list[tuple[str, str]]:
    """A seeded sample of the docstring questions of the training split (or of the held-out split, which
    the model never saw)."""
    pairs = []
    for rel, text in train.stdlib_files():
        if train.held_out(rel) == held_out:
            pairs += train.docstring_questions(rel, text)
    return random.Random(seed).sample(pairs, min(n, len(pairs)))


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", " ".join(text.split()), maxsplit=1)[0]


def answered(answer: str, reference: str) -> bool:
    want = first_sentence(reference)
    if " ".join(answer.split()).lower().startswith(want.lower()):
        return True
    target, got = words(want), set(words(answer)[:len(words(want)) + 5])
    return bool(target) and sum(w in got for w in target) > len(target) / 2


def held_out_perplexity(engine, train, windows: int, seq: int = 256) -> float:
    docs = []
    for rel, text in train.stdlib_files():
        if train.held_out(rel):
            docs += [text] + train.chat_turns(rel, text)
    eot = engine.codec.token_id("<|endoftext|>")
    ids: list[int] = []
    for doc in docs:
        ids += engine.codec.encode(doc) + [eot]
        if len(ids) > windows * seq + 1:
            break
    total, count = 0.0, 0
    for w in range(windows):
        chunk = ids[w * seq:(w + 1) * seq]
        logits = engine.logits(chunk)
        total += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--held-out", action="store_true",
                    help="ask the held-out split's questions instead: what the model was never taught")
    ap.add_argument("--windows", type=int, default=100)
    ap.add_argument("--show", type=int, default=3, help="print this many question/answer pairs")
    args = ap.parse_args()
    from mosaic_runtime.engine import Engine
    from mosaic_shatter.convert import convert

    train = training_script()
    asked = questions(train, args.questions, held_out=args.held_out)
    with tempfile.TemporaryDirectory() as tmp:
        vault = convert(str(args.model), Path(tmp) / "q4", "q4", progress=False).out
        with Engine.open(vault, max_seq=1024) as engine:
            hits, shown = 0, []
            for question, reference in asked:
                answer = "".join(engine.generate([{"role": "user", "content": question}], max_new_tokens=64))
                ok = answered(answer, reference)
                hits += ok
                if len(shown) < args.show:
                    shown.append({"question": question, "reference": first_sentence(reference), "answer": answer,
                                  "counted": ok})
        with Engine.open(vault, max_seq=1024, precision="exact") as engine:
            ppl = held_out_perplexity(engine, train, args.windows)
    for s in shown:
        print(json.dumps(s, ensure_ascii=False))
    print(json.dumps({"model": str(args.model), "split": "held-out" if args.held_out else "training",
                      "questions": len(asked), "answered": hits,
                      "share": round(hits / len(asked), 3), "held_out_perplexity": round(ppl, 2)}))


if __name__ == "__main__":
    main()
