"""Markdown tables for the measurement reports (bench.md, sweep.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_RULES = {"l": "---", "r": "---:"}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """A table's lines: the header, the alignment row (`align`: a letter a column, l left or r right: numbers) and a
    line a row, each cell as str() gives it."""
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns but {len(align)} alignments ({align!r})")
    return [_line(header), "|" + "".join(_RULES[a] + "|" for a in align), *(_line(row) for row in rows)]


def _line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def interval(estimate: dict, digits: int, unit: str = "") -> str:
    """`value [low, high]` of an estimate with its interval, at `digits` decimals (`unit` after the value: "x")."""
    return f"{estimate['value']:.{digits}f}{unit} [{estimate['low']:.{digits}f}, {estimate['high']:.{digits}f}]"
