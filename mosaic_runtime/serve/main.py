"""`mosaic serve`: resolve the models, load the first, and run the app on uvicorn until interrupted."""

from __future__ import annotations

import ipaddress
import logging
import sys
from pathlib import Path

from ..engine import Engine
from ..model_store import list_models, resolve_model
from ..vault.format import VaultError
from .app import Server, build_app
from .fleet import Fleet, ModelEntry
from .worker import Worker

log = logging.getLogger("mosaic.serve")


def fleet_entries(models: list[str]) -> list[ModelEntry]:
    """The models given (paths or store names), then the rest of the store; a name is listed once.

    Raises:
        LookupError: a given model is neither a model directory nor a store name.
    """
    entries: dict[str, ModelEntry] = {}
    for name in models:
        path = resolve_model(name)
        label = path.name if Path(name).expanduser().exists() else name
        entries.setdefault(label, ModelEntry(label, path))
    for stored in list_models():
        if all(e.path.resolve() != stored.path.resolve() for e in entries.values()):
            entries.setdefault(stored.name, ModelEntry(stored.name, stored.path))
    return list(entries.values())


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(models: list[str], *, host: str, port: int, api_key: str | None, max_seq: int,
               ram_budget: int | None, io: str | None, exact: bool, kv_dtype: str, threads: int | None,
               prompt_cache: bool, log_level: str) -> int:
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="mosaic: %(message)s")
    try:
        fleet = Fleet(fleet_entries(models), lambda path: Engine.open(
            path, ram_budget=ram_budget, io=io, threads=threads, max_seq=max_seq,
            precision="exact" if exact else "fast", kv_dtype=kv_dtype), prompt_cache)
    except (LookupError, ValueError) as e:
        print(f"mosaic: {e}", file=sys.stderr)
        return 2
    worker = Worker(fleet)
    try:  # the first model loads before the port opens: a bad vault is one line now, not a failed request later
        engine, _ = worker.call(lambda: fleet.load(fleet.default))
    except (VaultError, ValueError, NotImplementedError, OSError) as e:
        print(f"mosaic: cannot load {fleet.default.name}: {e}", file=sys.stderr)
        return 1
    limit = engine.memory_limit
    records = engine.vault.header.num_records
    ring = f"ring {engine.store.policy.usable} of {records} experts" if engine.store else "no ring"
    log.info("%s loaded (%s; %s%s); serving %s", fleet.default.name, engine.arch["model_type"], ring,
             f", memory bounded by {limit.bound}" if limit else "", ", ".join(fleet.entries))
    if not is_loopback(host) and not api_key:
        log.warning("listening on %s without an API key: anyone who can reach this port can use it "
                    "(give --api-key or MOSAIC_API_KEY)", host)
    server = Server(fleet, worker, max_seq=max_seq, api_key=api_key)
    log.info("web chat and API on http://%s:%d/", host if ":" not in host else f"[{host}]", port)
    try:
        uvicorn.run(build_app(server), host=host, port=port, log_level="warning")
    finally:
        worker.call(fleet.close)
        worker.stop()
    return 0
