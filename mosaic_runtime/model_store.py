"""The model store: converted model directories under MOSAIC_HOME (default ~/.cache/mosaic), by name.

`mosaic-shatter convert SOURCE` without -o writes into it; `mosaic list` shows it; `mosaic chat NAME` and
`mosaic serve` take its names as well as paths."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .vault import VaultError, open_vault
from .vault.format import BACKBONE_FILE, VAULT_FILE


def mosaic_home() -> Path:
    return Path(os.environ.get("MOSAIC_HOME") or "~/.cache/mosaic").expanduser()


def models_dir() -> Path:
    return mosaic_home() / "models"


def store_name(source: str, quant: str) -> str:
    """A readable store name for a conversion: 'Qwen/Qwen3-30B-A3B', q4 -> 'qwen3-30b-a3b-q4'."""
    base = Path(source.rstrip("/")).name  # a directory's name, or a repo id's
    return re.sub(r"[^a-z0-9._-]+", "-", f"{base}-{quant}".lower()).strip("-.")


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path
    model_type: str
    quant: str
    vault_bytes: int
    backbone_bytes: int
    source: str  # the repo id, or the directory it was converted from


def describe(path: Path, name: str | None = None) -> StoredModel:
    """What a model directory holds, from its vault's header, arch and lineage blocks.

    Raises:
        VaultError: not a readable vault.
    """
    with open_vault(path) as vault:
        src = vault.lineage.get("source", {}) if isinstance(vault.lineage, dict) else {}
        return StoredModel(name or path.name, path, str(vault.arch.get("model_type", "?")), vault.quant,
                           (path / VAULT_FILE).stat().st_size, (path / BACKBONE_FILE).stat().st_size,
                           str(src.get("repo_id") or src.get("path") or "?"))


def list_models() -> list[StoredModel]:
    """Every readable model directory in the store, by name; directories that are not vaults are skipped."""
    root, found = models_dir(), []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if (path / VAULT_FILE).is_file():
            try:
                found.append(describe(path))
            except (VaultError, OSError):
                continue
    return found


def resolve_model(name_or_path: str) -> Path:
    """A model directory from a path or a store name.

    Raises:
        LookupError: neither; the message says what to run (a checkpoint to convert, a repo id downloaded
            but not converted, or the names the store has).
    """
    path = Path(name_or_path).expanduser()
    if (path / VAULT_FILE).is_file():
        return path
    stored = models_dir() / name_or_path
    if "/" not in name_or_path and (stored / VAULT_FILE).is_file():
        return stored
    if (path / "config.json").is_file():
        raise LookupError(f"{path} is a Hugging Face checkpoint, not a Mosaic model directory. Convert it once "
                          f"with:\n  mosaic-shatter convert {path} --quant q4")
    if path.exists():
        raise LookupError(f"{path} holds no {VAULT_FILE}: give a directory written by `mosaic-shatter convert`")
    if name_or_path.count("/") == 1 and _in_hub_cache(name_or_path):
        raise LookupError(f"{name_or_path} is downloaded but not converted. Convert it once with:\n"
                          f"  mosaic-shatter convert {name_or_path} --quant q4\n"
                          f"then use the name {store_name(name_or_path, 'q4')}")
    names = [m.name for m in list_models()]
    have = f"the store ({models_dir()}) has: {', '.join(names)}" if names else f"the store ({models_dir()}) is empty"
    raise LookupError(f"{name_or_path}: no such model directory or store name; {have}")


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import snapshot_download
        snapshot_download(repo_id, local_files_only=True)
        return True
    except Exception:  # noqa: BLE001 - not cached, or not a valid repo id: either way, not downloaded
        return False
