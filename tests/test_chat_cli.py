"""`mosaic chat`, driven for real: through a pipe (scripted turns) and a pseudo-terminal (Ctrl-C)."""

import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time

import pytest

from builders import add_chat_tokenizer, random_qwen3_moe
from mosaic_runtime import _native
from mosaic_runtime.chat import Conversation
from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert

CHAT = [sys.executable, "-m", "mosaic_runtime.cli", "chat"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatcli")
    ckpt = random_qwen3_moe(root / "ckpt", seed=5, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2)
    model = convert(str(ckpt), root / "q4", "q4", progress=False).out
    add_chat_tokenizer(model)
    return ckpt, model


def prefilled(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"(\d+) prompt tokens prefilled", out)]


def test_pipe_answers_each_line_and_keeps_the_cache_across_turns(dirs):
    _, model = dirs
    script = "def add(a, b):\n/stats\nand again\n/stats\n/reset\ndef add(a, b):\n/stats\n/quit\nnever read\n"
    res = subprocess.run([*CHAT, str(model), "--temperature", "0", "--max-tokens", "6"], input=script,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    first, second, after_reset = prefilled(res.stdout)
    # The same conversation in-process: what each turn's whole prompt is, and what the cache kept.
    engine = Engine.open(model, max_seq=256)
    conv = Conversation(engine)
    answer1 = "".join(conv.ask("def add(a, b):", max_new_tokens=6))
    whole1 = engine.codec.encode(engine.codec.render_chat(conv.messages[:1]))
    assert first == len(whole1) and conv.cached_ids[:first] == whole1
    cached = len(conv.cached_ids)
    "".join(conv.ask("and again", max_new_tokens=6))
    # Only what is new since the cache was filled is prefilled: the turn's end, the new message, the
    # assistant header; the first prompt and the answer's tokens stay cached.
    new_text = engine.codec.render_chat(conv.messages[:3])[len(engine.codec.decode(conv.cached_ids[:cached], False)):]
    assert second == engine.stats.prompt_tokens == len(engine.codec.encode(new_text))
    assert cached == first + 6 - 1  # 6 generated (no stop), the last one not yet fed
    # (it starts with the piece of the answer's last token, which was generated but not yet fed)
    assert new_text.endswith("<|im_end|>\n<|im_start|>user\nand again<|im_end|>\n<|im_start|>assistant\n")
    assert "(conversation reset)" in lines
    assert after_reset == first  # after /reset the cache is empty again: the whole first prompt
    assert lines[0] == answer1 and lines.count(answer1) == 2  # greedy: the first answer comes again
    assert "never read" not in res.stdout


@pytest.mark.parametrize("flags, want", [
    ([], "precision fast, kernel {fast}, backbone {backbone}, kv_dtype float32"),
    (["--exact"], "precision exact, kernel native, backbone bf16, kv_dtype float32"),
    (["--exact", "--backbone", "q4", "--kv-dtype", "int8", "--kernel", "torch"],
     "precision exact, kernel torch, backbone q4, kv_dtype int8"),
])
def test_precision_options_reach_the_engine(dirs, flags, want):
    _, model = dirs
    vnni = _native.kernels.int8_isa() is not None
    res = subprocess.run([*CHAT, str(model), *flags], input="/stats\n", capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert want.format(fast="native-int8" if vnni else "native", backbone="q4" if vnni else "int8") in res.stdout


def test_a_corrupted_record_is_one_line_and_a_verify_hint(dirs, tmp_path):
    import shutil
    from mosaic_runtime.vault import open_vault
    _, model = dirs
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    with open_vault(bad) as vault:
        offsets = [e.offset for e in vault.entries.values()]
    with open(bad / "experts.vault", "r+b") as f:  # every record, so whatever the answer routes to is damaged
        for at in offsets:
            f.seek(at + 100)
            byte = f.read(1)
            f.seek(at + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    res = subprocess.run([*CHAT, str(bad), "--max-tokens", "4"], input="def add(a, b):\n", capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "CRC" in lines[0] and f"mosaic-shatter verify {bad}" in lines[0]


def test_a_failing_chat_template_is_one_line_and_the_chat_goes_on(dirs, tmp_path):
    import json
    import shutil
    _, model = dirs
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ 1 / 0 }}"
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    res = subprocess.run([*CHAT, str(bad), "--max-tokens", "2"], input="hi\n/stats\n", capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "chat template failed: ZeroDivisionError" in lines[0]
    assert "precision" in res.stdout  # the next command still ran


def test_a_checkpoint_directory_gets_the_convert_command(dirs):
    ckpt, _ = dirs
    res = subprocess.run([*CHAT, str(ckpt)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "Hugging Face checkpoint" in res.stderr and f"mosaic-shatter convert {ckpt}" in res.stderr


def read_until(fd, pattern: str, timeout: float = 60.0) -> str:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            if re.search(pattern, out.decode("utf-8", "replace")):
                return out.decode("utf-8", "replace")
    raise AssertionError(f"never saw {pattern!r} in {out.decode('utf-8', 'replace')[-500:]!r}")


def test_ctrl_c_stops_the_answer_not_the_program(dirs, tmp_path):
    import json
    import shutil
    model = tmp_path / "endless"
    shutil.copytree(dirs[1], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("eos_token")  # no stop token: the answer runs until Ctrl-C (or its 3000 tokens)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    master, slave = pty.openpty()

    def controlling_terminal():  # so that the ^C byte becomes SIGINT, as in a real terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen([*CHAT, str(model), "--max-tokens", "3000", "--max-seq", "4096", "--temperature", "1"],
                            stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling_terminal, close_fds=True)
    os.close(slave)
    try:
        read_until(master, r">>> ")
        os.write(master, b"def add(a, b):\n")
        read_until(master, r"def add\(a, b\):\r?\n[\s\S]{20}")  # the echo, then the answer streaming
        os.write(master, b"\x03")
        read_until(master, r"\[stopped\]\r?\n>>> ")
        os.write(master, b"/stats\n")
        stats = read_until(master, r"per layer: .*\r?\n>>> ")
        assert re.search(r"\d+ prompt tokens prefilled, (\d+) generated", stats)
        generated = int(re.search(r"prefilled, (\d+) generated", stats).group(1))
        assert 0 < generated < 3000
        os.write(master, b"/quit\n")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
