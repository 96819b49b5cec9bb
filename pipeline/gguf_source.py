"""A `.gguf` file as a model source: checked to be GGUF, dequantized once through transformers into a safetensors
checkpoint under $DRAFTOPS_HOME/models (keyed by the file's path, size and time) and reused."""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline import draftops_home
from pipeline.files import swap_dir, temporary_sibling


class GGUFError(ValueError):
    """A file that is not GGUF, or that cannot be read as a GGUF model."""


def file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def check_gguf_magic(path: Path) -> None:
    """A GGUF file starts with the bytes `GGUF`; anything else is refused before a converter reads it."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")


@contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses the whole GGUF anew for its config, its tokenizer and its weights, and builds gguf's
    tensor-name map once per module of the model, a large share of a first load's time (docs/results.md): for the
    duration each file is parsed once and each map built once (read-only objects, shared)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def reader(path, mode="r"):
        return reader_class(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def gguf_checkpoint(gguf: Path) -> Path:
    """Dequantize a GGUF once into a safetensors checkpoint under $DRAFTOPS_HOME/models and reuse it; GGUFError for
    a file that is not GGUF or that its reader cannot read."""
    check_gguf_magic(gguf)
    key = hashlib.sha256(file_identity(gguf).encode()).hexdigest()[:12]
    out = draftops_home() / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").exists() and (out / "model.safetensors").exists():
            return out
        print(f"draftops: dequantizing {gguf.name} once into {out} (about a minute on a CPU)")
        try:
            with _parsed_once():
                gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as exc:  # a damaged or unsupported file: whatever the reader raises, one line
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise GGUFError(f"{gguf}: cannot be read as a GGUF model: {type(exc).__name__}: {first}") from None
        config = gguf_model.config
        # A GGUF-loaded model refuses save_pretrained, and a kept quantization_config would make the
        # saved checkpoint claim to be GGUF again: rebuild a plain model from the dequantized weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        tmp = temporary_sibling(out)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        swap_dir(tmp, out)
    return out
