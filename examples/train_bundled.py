"""Train the bundled default model: a small Qwen3-MoE on this Python's own standard library.

    python examples/train_bundled.py [--minutes 25] [--chat-minutes 40] [--out examples/stdlib-moe]
    python examples/train_bundled.py --init examples/stdlib-moe --chat-minutes 40   # the chat phase alone

Data: every .py file of the standard library (site-packages excluded), in path order; a file goes to the
held-out split when the CRC-32 of its relative path is 0 mod 20 (about 5 %). Beside plain source the
training stream carries chat turns made from the library's own docstrings ("What does `json.dumps` do?"
-> the docstring's first paragraph), so the chat template has something real to answer.

Tokenizer: byte-level BPE trained with `tokenizers` on the training split. Model: `transformers`'
Qwen3-MoE, trained from scratch on the CPU with the router's load-balancing loss. Everything is seeded;
the wall-clock budget decides the number of steps, so the step count is recorded in the model card.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import time
import warnings
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SEED = 0
VOCAB = 4096
SEQ = 256
BATCH = 16
CHAT_ROWS = 12  # of each batch's BATCH rows in the chat phase
CHAT_LR = 1e-3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with tools in Qwen3's format (a system block listing them, <tool_call> JSON in assistant turns,
# results in <tool_response> user turns): a conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}{%- set fn = call.function or call %}"
    "{{- ('\\n' if m.content or not loop.first else '') + '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
              num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
              max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
              router_aux_loss_coef=0.01, output_router_logits=True,
              bos_token_id=0, eos_token_id=2, pad_token_id=0)


def stdlib_files() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        try:
            out.append((rel, p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 20 == 0


def module_name(rel: str) -> str:
    name = rel[:-3].replace("/", ".")
    return name[:-9] if name.endswith(".__init__") else name


def docstring_questions(rel: str, source: str) -> list[tuple[str, str]]:
    """One (question, answer) per documented public function or class: the question names it, the answer
    is the first paragraph of its docstring."""
    try:
        with warnings.catch_warnings():  # another project's invalid escapes and the like are not ours to report
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    mod, pairs = module_name(rel), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc:
                answer = doc.strip().split("\n\n")[0].strip()
                if 10 <= len(answer) <= 600:
                    pairs.append((f"What does `{mod}.{node.name}` do?", answer))
    return pairs


def chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def chat_turns(rel: str, source: str) -> list[str]:
    """The docstring questions as ChatML turns, as they appear in the training text."""
    return [f"{chat_prompt(q)}{a}<|im_end|>\n" for q, a in docstring_questions(rel, source)]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_all(tok, docs: list[str]) -> torch.Tensor:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model, data: torch.Tensor, max_windows: int = 200) -> float:
    """exp(mean next-token loss) over non-overlapping SEQ windows of data (the first max_windows)."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // SEQ)
    total, count = 0.0, 0
    for i in range(0, n, BATCH):
        rows = [data[j * SEQ:(j + 1) * SEQ + 1] for j in range(i, min(n, i + BATCH))]
        batch = torch.stack(rows)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone())
        # transformers shifts labels itself: feed the window, score SEQ-1 predictions per row
        total += out.loss.item() * batch.shape[0] * (SEQ - 1)
        count += batch.shape[0] * (SEQ - 1)
    model.train()
    return math.exp(total / count)


def sample(model, tok, prompt: str, n: int = 48) -> str:
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.token_to_id("<|im_end|>"))
    return tok.decode(out[0, ids.shape[1]:].tolist())


def chat_examples(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Each docstring question as token ids and labels: only the answer and its closing <|im_end|> are
    scored. The prompt is encoded on its own, as the chat renders it before the model answers."""
    newline = tok.encode("\n").ids
    out = []
    for question, answer in pairs:
        prompt, reply = tok.encode(chat_prompt(question)).ids, tok.encode(answer + "<|im_end|>").ids
        out.append((prompt + reply + newline, [-100] * len(prompt) + reply + [-100] * len(newline)))
    return out


class Batches:
    """Training batches: LM rows are random windows of the training text; chat rows each open on a
    docstring question (as a chat does) and are packed with the following ones, the questions taken in a
    fresh seeded order every pass."""

    def __init__(self, train: torch.Tensor, chat: list[tuple[list[int], list[int]]], gen: torch.Generator):
        self.train, self.chat, self.gen = train, chat, gen
        self.order: list[int] = []

    def _next_question(self) -> tuple[list[int], list[int]]:
        if not self.order:
            self.order = torch.randperm(len(self.chat), generator=self.gen).tolist()
        return self.chat[self.order.pop()]

    def _chat_row(self) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        labels: list[int] = []
        while len(ids) < SEQ:
            more_ids, more_labels = self._next_question()
            ids += more_ids
            labels += more_labels
        return ids[:SEQ], labels[:SEQ]

    def __call__(self, chat_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - SEQ - 1, (BATCH - chat_rows,), generator=self.gen)
        ids = torch.stack([self.train[s:s + SEQ] for s in starts.tolist()])
        labels = ids.clone()
        if chat_rows:
            rows = [self._chat_row() for _ in range(chat_rows)]
            ids = torch.cat([ids, torch.tensor([r[0] for r in rows])])
            labels = torch.cat([labels, torch.tensor([r[1] for r in rows])])
        return ids, labels


def train_phase(model, opt, batches: Batches, *, name: str, minutes: float, peak_lr: float, chat_rows: int,
                warmup: int) -> dict:
    """Train for a wall-clock budget: linear warm-up, then cosine decay to a tenth over the budget."""
    budget = minutes * 60
    step, tokens_seen, start = 0, 0, time.monotonic()
    while (elapsed := time.monotonic() - start) < budget:
        frac = elapsed / budget
        lr = peak_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = batches(chat_rows)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += ids.numel()
        if step % 50 == 0:
            print(f"{name} step {step}  {elapsed / 60:5.1f} min  loss {out.loss.item():.3f}  lr {lr:.2e}",
                  flush=True)
    return {"phase": name, "steps": step, "tokens_seen": tokens_seen, "chat_rows_per_batch": chat_rows,
            "peak_lr": peak_lr, "minutes": round((time.monotonic() - start) / 60, 1),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget of the language phase")
    ap.add_argument("--chat-minutes", type=float, default=40.0,
                    help="wall-clock budget of the chat phase (docstring questions, the answers scored)")
    ap.add_argument("--init", type=Path, default=None,
                    help="a model this script trained: keep its tokenizer, weights and language phase, and "
                         "run the chat phase on it")
    ap.add_argument("--out", type=Path, default=HERE / "stdlib-moe")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    random.seed(SEED)
    torch.manual_seed(SEED)
    if args.threads:
        torch.set_num_threads(args.threads)
    files = stdlib_files()
    train_docs, test_docs, pairs = [], [], []
    for rel, text in files:
        if held_out(rel):
            test_docs += [text] + chat_turns(rel, text)
        else:
            train_docs += [text] + chat_turns(rel, text)
            pairs += docstring_questions(rel, text)
    random.shuffle(train_docs)
    t0 = time.monotonic()
    tok = Tokenizer.from_file(str(args.init / "tokenizer.json")) if args.init else train_tokenizer(train_docs)
    train, test = encode_all(tok, train_docs), encode_all(tok, test_docs)
    print(f"{len(files)} files; tokens: train {len(train):,}, held-out {len(test):,}; {len(pairs)} docstring "
          f"questions; tokenizer {time.monotonic() - t0:.0f} s", flush=True)

    gen = torch.Generator().manual_seed(SEED)
    batches = Batches(train, chat_examples(tok, pairs), gen)
    if args.init:
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        model.config.output_router_logits = True
        phases = [p for p in json.loads((args.init / "training.json").read_text())["phases"]
                  if p["phase"] == "language"]
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **CONFIG))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        phases = [train_phase(model, opt, batches, name="language", minutes=args.minutes, peak_lr=3e-3,
                              chat_rows=0, warmup=100)]
    params = sum(p.numel() for p in model.parameters())
    # the chat phase: most rows are docstring questions with only the answers scored, so that the chat
    # answers what it was taught; the rest stay plain text, so that the language model is kept
    opt = torch.optim.AdamW(model.parameters(), lr=CHAT_LR, betas=(0.9, 0.95), weight_decay=0.1)
    phases.append(train_phase(model, opt, batches, name="chat", minutes=args.chat_minutes, peak_lr=CHAT_LR,
                              chat_rows=CHAT_ROWS, warmup=50))

    model.config.output_router_logits = False
    ppl_test, ppl_train = perplexity(model, test), perplexity(model, train)
    print(f"held-out perplexity {ppl_test:.2f} (train {ppl_train:.2f}, chance {VOCAB})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # what a chat samples with unless it asks otherwise (the server reads it): at temperature 1 this small
    # model's first token strays often enough to derail the answer
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "model_max_length": CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    model.float()
    prompts = ["import os\n\n\ndef ", "class Queue:\n    \"\"\"", "    for key, value in ",
               chat_prompt("What does `json.dumps` do?")]
    samples = [(p, sample(model, tok, p)) for p in prompts]
    stats = {"python": sys.version.split()[0], "files": len(files), "train_tokens": len(train),
             "held_out_tokens": len(test), "docstring_questions": len(pairs), "parameters": params,
             "phases": phases, "held_out_perplexity": round(ppl_test, 2), "train_perplexity": round(ppl_train, 2),
             "samples": [{"prompt": p, "completion": c} for p, c in samples]}
    (args.out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    for p, c in samples:
        print(f"--- {p!r}\n{c}")


if __name__ == "__main__":
    main()
