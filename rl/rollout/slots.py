"""`GroupSlots`: the slot and queue bookkeeping both rollout engines share (RolloutEngine,
MultiTurnEngine). A group of N samples takes an aligned block of N slots and leaves whole;
groups wait in a FIFO of submitted prompts, fed lazily from an optional prompt iterator.

An engine using it sets `_free` (sorted free slot ids), `_active` ({group id: its N
slots}), `_new` (deque of (group id, prompt)) and `_source` (an iterator or None), and
defines `_new_group(prompt) -> group id` (validates and queues one prompt). Groups queued
elsewhere (RolloutEngine's resumed groups) count through `_other_queued()`.
"""
from __future__ import annotations

from typing import Any


class GroupSlots:
    """Mixin: queue pulling and the status properties of a group-slot engine."""

    def _other_queued(self) -> int:
        return 0

    def _pull_new(self) -> tuple[int, Any] | None:
        """The next queued (group id, prompt), pulling one from the iterator if the queue
        is empty; None when nothing is left."""
        if not self._new and self._source is not None:
            try:
                self._new_group(next(self._source))
            except StopIteration:
                self._source = None
        return self._new.popleft() if self._new else None

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_active_groups(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        """Groups waiting for slots (not counting an iterator's rest)."""
        return self._other_queued() + len(self._new)

    @property
    def idle(self) -> bool:
        """Nothing in the slots, nothing queued and the prompt iterator (if any) exhausted."""
        if self._active or self._other_queued() or self._new:
            return False
        if self._source is not None:
            item = self._pull_new()
            if item is None:
                return True
            self._new.appendleft(item)
            return False
        return True
