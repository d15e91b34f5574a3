"""How many requests the server may hand a channel's worker (docs/protocol.md, "The worker
channel"): the slots the worker offered and no claim has used yet. Pure: the shell claims with
`take`, gives back what the claim did not use with `settle`, and stops with `stop`.

The worker counts the same way (slots offered, minus rows received), so neither side ever holds
more rows than the worker has room for; a dropped channel forgets its slots on both sides.
"""

from __future__ import annotations

from typing import Final

__all__ = ["SLOTS_MAX", "Slots"]

#: The most a channel may have offered and not been handed (the claim route's `limit` cap).
SLOTS_MAX: Final = 1000


class Slots:
    """The unused slots of one channel, and whether a claim for them is in flight."""

    __slots__ = ("_claiming", "_free", "_stopped")

    def __init__(self) -> None:
        self._free = 0
        self._claiming = 0
        self._stopped = False

    @property
    def free(self) -> int:
        """Slots offered and not yet taken by a claim (0 once stopped)."""
        return 0 if self._stopped else self._free

    @property
    def claiming(self) -> bool:
        """A claim took slots and has not settled: its rows are still to come."""
        return self._claiming > 0

    @property
    def stopped(self) -> bool:
        return self._stopped

    def offer(self, count: int) -> None:
        """The worker freed `count` more slots. Raises `ValueError` for a count below 0 or one
        that would hold more than `SLOTS_MAX` (nothing changes then)."""
        if count < 0:
            raise ValueError(f"slots must be >= 0: {count!r}")
        if self._free + self._claiming + count > SLOTS_MAX:
            raise ValueError(f"a channel holds at most {SLOTS_MAX} free slots")
        self._free += count

    def take(self) -> int:
        """Every free slot, for one claim (0: nothing to claim, or stopped). The caller must
        `settle` it once the claim answered, whatever became of it."""
        if self._stopped:
            return 0
        taken, self._free = self._free, 0
        self._claiming += taken
        return taken

    def settle(self, taken: int, handed: int) -> None:
        """A claim of `taken` slots handed `handed` rows: the rest are free again (unless
        stopped). Raises `ValueError` if it handed more than it took."""
        if not 0 <= handed <= taken <= self._claiming:
            raise ValueError(f"settled {handed} of {taken} with {self._claiming} claiming")
        self._claiming -= taken
        self._free += taken - handed

    def withdraw(self, count: int) -> None:
        """Take back `count` slots offered with a frame that was then refused whole (as far as
        they are still free: a claim may have used them meanwhile)."""
        self._free -= min(max(count, 0), self._free)

    def stop(self) -> None:
        """The worker drains: no slot is offered to a claim any more."""
        self._stopped = True
