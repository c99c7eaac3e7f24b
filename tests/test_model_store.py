"""The model store: convert into it without -o, list it, and open its models by name."""

import json
import os
import subprocess
import sys

import pytest

from builders import add_chat_tokenizer, random_qwen3_moe
from mosaic_runtime.model_store import resolve_model, store_name

SHATTER = [sys.executable, "-m", "mosaic_shatter.cli"]
MOSAIC = [sys.executable, "-m", "mosaic_runtime.cli"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOSAIC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run(cmd, input=None, **env):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, input=input, env=dict(os.environ, **env))


def test_names_are_readable():
    assert store_name("Qwen/Qwen3-30B-A3B", "q4") == "qwen3-30b-a3b-q4"
    assert store_name("/data/ckpt/My Model v2/", "fp8") == "my-model-v2-fp8"


def test_convert_into_the_store_then_list_and_chat_by_name(home, tmp_path):
    ckpt = random_qwen3_moe(tmp_path / "Tiny-MoE", seed=3, eos_token_id=None, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2)
    add_chat_tokenizer(ckpt)
    res = run([*SHATTER, "convert", str(ckpt), "--quant", "q4", "--quiet"])
    assert res.returncode == 0, res.stderr
    path = home / "models" / "tiny-moe-q4"
    assert str(path) in res.stdout and "mosaic chat tiny-moe-q4" in res.stdout
    listing = run([*MOSAIC, "list"])
    assert listing.returncode == 0
    header, row = listing.stdout.splitlines()
    assert header.split()[:5] == ["NAME", "FAMILY", "QUANT", "VAULT", "BACKBONE"]
    assert row.split()[:3] == ["tiny-moe-q4", "qwen3_moe", "q4"] and str(ckpt.resolve()) in row
    assert resolve_model("tiny-moe-q4") == path
    chat = run([*MOSAIC, "chat", "tiny-moe-q4", "--temperature", "0", "--max-tokens", "3"], input="def f():\n")
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr


def test_what_is_not_in_the_store_says_what_to_run(home, tmp_path, monkeypatch):
    empty = run([*MOSAIC, "list"])
    assert "is empty" in empty.stdout and "mosaic-shatter convert" in empty.stdout
    res = run([*MOSAIC, "chat", "no-such-model"])
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no such model directory or store name" in res.stderr
    # A repo id downloaded into the Hugging Face cache but not converted: the one command to run.
    hub = tmp_path / "hub"
    snap = hub / "models--Org--Some-MoE" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (hub / "models--Org--Some-MoE" / "refs").mkdir()
    (hub / "models--Org--Some-MoE" / "refs" / "main").write_text("a" * 40)
    res = run([*MOSAIC, "chat", "Org/Some-MoE"], HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    assert res.returncode == 2 and "downloaded but not converted" in res.stderr
    assert "mosaic-shatter convert Org/Some-MoE --quant q4" in res.stderr


def test_serve_without_models_refuses_in_one_line(home):
    res = run([*MOSAIC, "serve"])
    assert res.returncode == 2 and "no models to serve" in res.stderr and "Traceback" not in res.stderr
