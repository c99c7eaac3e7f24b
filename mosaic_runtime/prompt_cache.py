"""Which leading tokens of a request an engine's sequence state already holds, so that only the rest is
prefilled: the prompt cache of a conversation that comes back turn after turn."""

from __future__ import annotations

from .models.state import SequenceState, StateSnapshot


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """The tokens a sequence state holds, and snapshots of its recurrent state where earlier prompts ended.

    A request shares a longest common prefix with the held tokens. A KV cache alone is cut back to that
    prefix. A recurrent (DeltaNet) state cannot be cut back, so it goes back to the latest snapshot inside
    the prefix (taken where each prompt ended, which is where the next turn of a conversation, re-rendered,
    usually stops agreeing: templates rewrite the answer), or starts afresh. Whoever feeds the state must
    tell the cache (prompt_fed, fed); a state changed behind its back is noticed by its length and dropped.
    """

    def __init__(self, state: SequenceState, max_snapshots: int = 4, enabled: bool = True):
        self.state, self.max_snapshots, self.enabled = state, max_snapshots, enabled
        self.ids: list[int] = []
        self.snapshots: list[StateSnapshot] = []

    def reuse(self, ids: list[int]) -> int:
        """Bring the state to the longest prefix of ids it can keep (at most all but the last token, whose
        logits the request needs); return its length."""
        if not ids:
            raise ValueError("a request needs at least one token")
        if not self.enabled or len(self.ids) != self.state.length:  # off, or refilled by someone else
            self.ids, self.snapshots = [], []
        shared = min(common_prefix(self.ids, ids), len(ids) - 1)
        keep = shared
        if shared < self.state.length and self.state.rewindable and not self.state.resumable(shared):
            keep = 0  # a window ring no longer holds what its layers need at that prefix
        elif shared < self.state.length and not self.state.rewindable:
            snaps = [s for s in self.snapshots if s.length <= shared]
            keep = max(snaps, key=lambda s: s.length).length if snaps else 0
            if snaps:
                self.state.restore(max(snaps, key=lambda s: s.length))
        self.snapshots = [s for s in self.snapshots if s.length <= keep]
        self.ids = self.ids[:keep]
        return keep

    def prompt_fed(self, ids: list[int]) -> None:
        """The state now holds exactly ids, a prompt: a turn boundary worth a snapshot of a recurrent state."""
        self.fed(ids)
        if not self.state.rewindable and self.state.length == len(ids):
            kept = [s for s in self.snapshots if s.length < len(ids)]
            self.snapshots = (kept + [self.state.snapshot()])[-self.max_snapshots:]

    def fed(self, ids: list[int]) -> None:
        """The state holds these tokens (as many of them as its length says)."""
        self.ids = list(ids[:self.state.length])

    def forget(self) -> None:
        """Hold nothing: the state is reset, as after a step that failed part-way through it."""
        self.state.reset()
        self.ids, self.snapshots = [], []
