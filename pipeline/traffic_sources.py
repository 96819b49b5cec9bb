"""Where traffic is read from: JSONL logs, JSON arrays (ShareGPT's usual file), and data sets kept with `datasets`
(a saved folder, parquet or arrow files), each as numbered records.

A path is a file, a saved data set folder (`Dataset.save_to_disk`), or a glob of them (rotated logs, data set
shards), read in the sorted order of the names; `.gz` files are read as gzip. Each record comes with where it is, for
its error: `file:line` in a JSONL file, `file: row N` (0-based, as `dataset[N]`) in the others.
"""
from __future__ import annotations

import codecs
import glob
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_GLOB_CHARACTERS = "*?["
_SKIP_CHUNK = 1 << 20
# the files `save_to_disk` writes at the top of a saved folder (one split; a DatasetDict)
_SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


class TrafficError(ValueError):
    """A traffic file or line that cannot be read; the message starts with `file:line:`."""


@dataclass
class Record:
    """One record of a traffic source: `where` names it in errors; `raw` is a JSONL line's bytes (None: longer than
    the bound), `row` a record already parsed (JSON arrays, data sets)."""

    where: str
    number: int
    container: str
    raw: bytes | None = None
    row: dict | None = None


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in _SAVED_DATASET_FILES)


def traffic_files(path: Path) -> list[Path]:
    """The file or saved data set folder, or the ones a glob matches, in sorted order; a path that exists is the
    file it names, glob characters (`log[1].jsonl`) and all."""
    if not path.exists() and any(c in str(path) for c in _GLOB_CHARACTERS):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file() or is_saved_dataset(Path(p)))
        if not files:
            raise TrafficError(f"{path}: no traffic file matches")
        return files
    if path.is_dir() and not is_saved_dataset(path):
        raise TrafficError(f"{path}: a directory, not a traffic file: a folder, but not one `datasets` saved (no "
                           f"{' or '.join(_SAVED_DATASET_FILES)}); name a file, or a glob such as {path}/*.jsonl")
    if path.exists() and not path.is_file() and not path.is_dir():
        kind = "a FIFO" if path.is_fifo() else "a socket" if path.is_socket() else "a device"
        raise TrafficError(f"{path}: {kind}, not a traffic file (traffic is read from a regular file)")
    if not path.is_file() and not path.is_dir():
        raise TrafficError(f"{path}: traffic file not found")
    return [path]


def container_of(path: Path) -> str:
    """jsonl, json (an array of records), parquet, arrow or dataset (a saved folder)."""
    if path.is_dir():
        return "dataset"
    suffixes = [s for s in path.suffixes if s != ".gz"]
    suffix = suffixes[-1] if suffixes else ""
    if suffix in (".parquet", ".arrow"):
        return suffix[1:]
    if suffix == ".json" and _first_byte(path) == b"[":
        return "json"
    return "jsonl"


def records(path: Path, max_line_bytes: int) -> Iterator[Record]:
    """Every record of one file or folder, in order."""
    container = container_of(path)
    try:
        if container == "jsonl":
            for line_no, raw in _raw_lines(path, max_line_bytes):
                yield Record(f"{path}:{line_no}", line_no, container, raw=raw)
            return
        rows = _json_rows(path) if container == "json" else _dataset_rows(path, container)
        for where, number, row in rows:
            yield Record(where, number, container, row=row)
    except (OSError, EOFError) as exc:  # a truncated or corrupt file
        raise TrafficError(f"{path}: cannot be read: {exc}") from None


def _first_byte(path: Path) -> bytes:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            while (byte := f.read(1)) and byte.isspace():
                pass
            return byte
    except (OSError, EOFError) as exc:
        raise TrafficError(f"{path}: cannot be read: {exc}") from None


def _raw_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Numbered raw lines, as bytes so that a bad byte is reported with its line; None for a line longer than
    `max_line_bytes`, whose rest is read in pieces and dropped. `.gz` files are decompressed."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        line_no = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            line_no += 1
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # what some editors put before the first line
                raw = raw[len(codecs.BOM_UTF8):]
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                    pass
                raw = None
            yield line_no, raw


def _json_rows(path: Path) -> Iterator[tuple[str, int, object]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        try:
            rows = json.load(f)
        except (ValueError, RecursionError) as exc:
            raise TrafficError(f"{path}: not a JSON array of records: {exc}") from None
    for n, row in enumerate(rows):
        yield f"{path}: row {n}", n, row


def _dataset_rows(path: Path, container: str) -> Iterator[tuple[str, int, dict]]:
    """Rows of a parquet file (read in batches by pyarrow), an arrow file or a saved folder (`datasets`, memory
    mapped), with their null columns dropped: a table's columns are the union of its records' fields. A file pyarrow
    cannot read (not parquet, cut short, a corrupt page; found when opened or at any later batch) is a TrafficError
    naming it."""
    import pyarrow

    if container == "parquet":
        import pyarrow.parquet as pq

        try:
            n = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for row in batch.to_pylist():
                    yield f"{path}: row {n}", n, _present(row)
                    n += 1
        except pyarrow.ArrowException as exc:
            raise TrafficError(f"{path}: not a parquet file pyarrow can read: {_first_line(exc)}") from None
        return
    import datasets

    try:
        loaded = datasets.Dataset.from_file(str(path)) if container == "arrow" else datasets.load_from_disk(str(path))
    except (ValueError, FileNotFoundError, pyarrow.ArrowException) as exc:
        raise TrafficError(f"{path}: not a data set `datasets` can read: {_first_line(exc)}") from None
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, dataset in sorted(splits, key=lambda item: item[0] or ""):
        name = f"{path}[{split}]" if split is not None else str(path)
        try:
            for n, row in enumerate(dataset):
                yield f"{name}: row {n}", n, _present(row)
        except pyarrow.ArrowException as exc:
            raise TrafficError(f"{name}: not a data set `datasets` can read: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _present(row: dict) -> dict:
    return {key: value for key, value in row.items() if value is not None}
