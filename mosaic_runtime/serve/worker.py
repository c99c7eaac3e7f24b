"""The engine's one worker thread: generations run one at a time, in arrival order, and report what they
produce as events on the asyncio side. A cancelled job (its client went away) stops within a token, or is
skipped if it had not started."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..generate import Detokenizer, StopText
from ..harmony import is_harmony
from ..vault.format import VaultError
from .fleet import Fleet, ModelEntry
from .request import Generation, RequestError
from .tool_calls import HarmonyText

log = logging.getLogger("mosaic.serve")
T = TypeVar("T")


@dataclass(frozen=True)
class Started:
    model: str
    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, how many the prompt cache already held


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of turn), "length" (max_tokens or the context), "stop_sequence", "cancelled"
    completion_tokens: int
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Failed:
    error: RequestError


Event = Started | Text | Finished | Failed


class Job:
    """A generation waiting for, or running on, the worker; events arrive on `events` in the event loop."""

    def __init__(self, entry: ModelEntry, gen: Generation, ids: list[int], loop: asyncio.AbstractEventLoop):
        self.entry, self.gen, self.ids, self.loop = entry, gen, ids, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (the server is stopping): nobody is listening
            self.cancelled.set()


class Worker:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._tasks: queue.Queue[Job | Callable[[], None] | None] = queue.Queue()
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="mosaic-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._tasks.qsize()

    def submit(self, job: Job) -> None:
        self._tasks.put(job)

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run on the worker thread after the jobs already queued (loading a model at start)."""
        future: Future = Future()
        self._tasks.put(lambda: _settle(future, fn))
        return future.result()

    def stop(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            if not isinstance(task, Job):
                task()
            elif not task.cancelled.is_set():
                self.running = task
                try:
                    self._run(task)
                except Exception as e:  # noqa: BLE001 - whatever one request hits, the worker serves the next
                    log.exception("generation failed")
                    task.emit(Failed(RequestError(f"the engine failed: {type(e).__name__}: {e}", status=500,
                                                  kind="engine")))
                finally:
                    self.running = None

    def _run(self, job: Job) -> None:
        gen = job.gen
        try:
            engine, cache = self.fleet.load(job.entry)
        except (VaultError, ValueError, NotImplementedError, OSError) as e:
            job.emit(Failed(RequestError(f"cannot load {job.entry.name}: {e}", status=500, kind="engine")))
            return
        codec = engine.codec
        keep = cache.reuse(job.ids)
        job.emit(Started(job.entry.name, len(job.ids), keep))
        room = engine.model.state.max_seq - len(job.ids)  # the answer ends where the context does
        sampling = job.entry.sampling(gen)
        tokens = engine.generate_ids(job.ids[keep:], cached=keep, max_new_tokens=min(gen.max_tokens, room + 1),
                                     stop_ids=codec.end_of_turn_ids, cancelled=job.cancelled.is_set, **sampling)
        answer: list[int] = []
        try:
            reason, stopped = self._stream(job, engine, cache, tokens, answer)
        except VaultError as e:
            cache.forget()  # a forward that failed part-way may have left a recurrent state half-updated
            job.emit(Failed(RequestError(f"{e}; check the vault with: mosaic-shatter verify {job.entry.path}",
                                         status=500, kind="engine")))
            return
        except BaseException:
            cache.forget()
            raise
        finally:
            tokens.close()
        cache.fed(job.ids + answer)
        job.emit(Finished(reason, engine.stats.new_tokens, stopped))

    @staticmethod
    def _stream(job: Job, engine, cache, tokens, answer: list[int]) -> tuple[str, str | None]:
        """Emit the answer's text as its tokens come, into answer; (why it ended, the stop string if one). A
        model answering in harmony's channels (gpt-oss) is answered with its final channel and its function
        calls (HarmonyText)."""
        cut = StopText(job.gen.stop)
        text = HarmonyText(engine.codec, job.ids) if is_harmony(engine.codec) else Detokenizer(engine.codec)
        for n, token in enumerate(tokens):
            if n == 0:
                cache.prompt_fed(job.ids)  # the state holds the prompt exactly: a turn boundary
            answer.append(token)
            out = cut.push(text.push(token))
            if out:
                job.emit(Text(out))
            if cut.stopped is not None:
                return "stop_sequence", cut.stopped
            if job.cancelled.is_set():
                return "cancelled", None
        if job.cancelled.is_set():  # during prefill: nothing was generated
            return "cancelled", None
        out = cut.finish(text.flush())
        if out:
            job.emit(Text(out))
        if cut.stopped is not None:
            return "stop_sequence", cut.stopped
        return ("length" if len(answer) == engine.stats.new_tokens else "stop"), None  # an end of turn is counted


def _settle(future: Future, fn) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
        future.set_exception(e)
