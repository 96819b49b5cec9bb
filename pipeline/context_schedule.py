"""A value by context length: `[(max_context, value), ...]` with increasing max_context, the value of the first entry
whose max_context is at least the sequence's length, the last value beyond them. γ by context
(`decode.gamma_schedule`) and the token tree's node budget by context (`decode.tree_budget_schedule`) are both one."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ContextSchedule:
    entries: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, raw: Sequence[Sequence[int]], name: str = "schedule") -> ContextSchedule:
        """The schedule of `raw`, or a ValueError naming `name` (a config key) and what a schedule must be."""
        try:
            entries = tuple((int(m), int(v)) for m, v in raw)
        except (TypeError, ValueError):
            entries = ()
        if (not entries or any(v < 1 or m < 1 for m, v in entries)
                or any(a[0] >= b[0] for a, b in zip(entries, entries[1:]))):
            raise ValueError(f"{name} must be a non-empty [[max_context, value], ...] with increasing max_context and "
                             f"values >= 1, got {raw!r}")
        return cls(entries)

    def at(self, length: int) -> int:
        """The value for a sequence of `length` tokens."""
        return next((value for max_context, value in self.entries if length <= max_context), self.entries[-1][1])

    def largest(self) -> int:
        return max(value for _, value in self.entries)

    def as_lists(self) -> list[list[int]]:
        return [list(entry) for entry in self.entries]
