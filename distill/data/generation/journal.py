"""Finished engine responses, appended to a file one JSON line each as they arrive, so that a run killed at any
point keeps all but the requests in flight, and a rerun asks only for the rest.

A line is written whole and flushed before the next request's is (the operating system keeps what a killed process
wrote). A last line cut by the kill is dropped when the journal is opened again, and a request that appears twice
(never, short of a bug) counts once: the first line wins. The journal only collects: `distill.data.generation
.generate` turns a complete sample round into the response cache's atomic `sample-<i>/` folder and deletes the
journal when every round is there.
"""
from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


@dataclass
class Record:
    """One finished response: its tokens and teacher rows ([n, k] fp16 log-probs, int32 ids)."""

    tokens: list[int]
    logprobs: torch.Tensor
    indices: torch.Tensor


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.contiguous().numpy().tobytes()).decode()


def _decode(text: str, dtype, shape: tuple[int, int]) -> torch.Tensor:
    array = np.frombuffer(base64.b64decode(text), dtype=dtype)
    return torch.from_numpy(array.reshape(shape).copy())


class Journal:
    """The append-only file of finished responses of one cache entry, keyed by (sample round, prompt index)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = None

    def load(self) -> dict[tuple[int, int], Record]:
        """Every whole line's record (a torn or unreadable line is skipped: its request is asked again)."""
        records: dict[tuple[int, int], Record] = {}
        if not self.path.exists():
            return records
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    break  # the last line, cut by a kill
                try:
                    data = json.loads(line)
                    n, k = len(data["tokens"]), int(data["k"])
                    record = Record([int(t) for t in data["tokens"]], _decode(data["logprobs"], np.float16, (n, k)),
                                    _decode(data["ids"], np.int32, (n, k)))
                    key = (int(data["sample"]), int(data["index"]))
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("%s: line %d unreadable (%s); its request is asked again", self.path, number, exc)
                    continue
                records.setdefault(key, record)
        return records

    def _open(self):
        """Open for appending, after cutting a torn last line (a kill mid-write) off the end."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                with open(self.path, "rb+") as f:
                    data = f.read()
                    whole = data.rfind(b"\n") + 1
                    if whole < len(data):
                        f.truncate(whole)
            self._file = open(self.path, "ab")
        return self._file

    def append(self, key: tuple[int, int], record: Record) -> None:
        """Write one response's line whole and flush it."""
        sample, index = key
        line = json.dumps({"sample": sample, "index": index, "k": int(record.logprobs.shape[1]),
                           "tokens": record.tokens, "logprobs": _encode(record.logprobs.half()),
                           "ids": _encode(record.indices.int())}) + "\n"
        out = self._open()
        out.write(line.encode())
        out.flush()

    def close(self) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
