"""`draftops export`: a distilled draft in the form a serving engine loads, checked before it is written.

A draftops draft (`distill.register.export_draft`) carries files only draftops reads: a reduced head and its
`draft_vocab.json`, the suffix index, the resolved config, a full-vocabulary `hf_assistant/` copy. This module writes
one of the clean folders of `FORMATS` instead (`hf`, `vllm`, `speculators`, `gguf`; which family takes which and what
each engine is given: docs/guide.md#export-and-serve), each read back or checked against its source before it is
swapped into place. It is apart from the engines' runners (`decode.serving.llamacpp`) and writers
(`decode.serving.gguf`, `decode.serving.eagle3_gguf`): it only assembles and checks folders.
"""
from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from decode.models.layer_draft import full_vocab_copy
from decode.serving.eagle3_gguf import check_eagle3_gguf, write_eagle3_gguf
from decode.serving.gguf import GGUF_DTYPES, GGUFExportError, write_llama_gguf
from decode.serving.speculators import WEIGHTS_FILE
from pipeline.files import swap_dir, temporary_sibling
from pipeline.registry_cache import MANIFEST as REGISTRY_MANIFEST
from pipeline.sources import (
    CONFIG_FILE,
    DRAFT_VOCAB_FILE,
    HF_ASSISTANT_DIR,
    NAMED_GGUF,
    SUFFIX_INDEX_FILE,
    TREE_ACCEPTANCE_FILE,
    is_speculators_dir,
    load_checkpoint,
    locate,
    named_gguf_path,
)

HF, VLLM, SPECULATORS, GGUF = "hf", "vllm", "speculators", "gguf"
FORMATS = (HF, VLLM, SPECULATORS, GGUF)
LAYERS, FEATURES = "layers", "features"  # the draft families, as `pipeline.sources.checkpoint_info` names them
FORMATS_OF = {LAYERS: (HF, VLLM, GGUF), FEATURES: (VLLM, SPECULATORS, GGUF)}
GGUF_CHECK_TOKENS = 32  # positions whose logits the GGUF read back must reproduce
# read by draftops alone: never exported
# draftops' own files in a draft's folder, never exported: its vocabulary map, suffix index, tree acceptance, config,
# and the manifest of a registered version's download (`pipeline.registry_cache`)
DRAFTOPS_FILES = (DRAFT_VOCAB_FILE, SUFFIX_INDEX_FILE, TREE_ACCEPTANCE_FILE, CONFIG_FILE, REGISTRY_MANIFEST)


class ExportError(ValueError):
    """A draft that cannot be exported in the asked format, or a folder that cannot take it."""


@dataclass
class DraftSource:
    """A located draftops draft: its folder, its family, and the target and γ it records (None where it does not)."""

    source: str
    path: Path
    family: str
    target: str | None
    gamma: int | None


def draft_source(source: str) -> DraftSource:
    """Locate `source` (a folder or `models:/` URI; `setup_mlflow` first for the latter) and check it is a draftops
    draft: a speculators folder (feature draft), or a checkpoint with draftops' config or vocabulary file (layer
    draft). A GGUF is refused before it is converted."""
    if source in NAMED_GGUF or Path(source).suffix == ".gguf":
        raise ExportError(f"{source} is a GGUF model, not a draftops draft")
    path = locate(source).path
    recorded = yaml.safe_load((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).is_file() else {}
    if is_speculators_dir(path):
        config = json.loads((path / "config.json").read_text()).get("speculators_config", {})
        methods = config.get("proposal_methods") or [{}]
        return DraftSource(source, path, FEATURES,
                           recorded.get("target") or config.get("verifier", {}).get("name_or_path"),
                           recorded.get("decode", {}).get("gamma") or methods[0].get("speculative_tokens"))
    if not recorded and not (path / DRAFT_VOCAB_FILE).is_file():
        raise ExportError(f"{source} is not a draftops draft (no {CONFIG_FILE} or {DRAFT_VOCAB_FILE} in {path}): "
                          "export what `draftops distill` wrote, e.g. outputs/distill/latest")
    return DraftSource(source, path, LAYERS, recorded.get("target"), recorded.get("decode", {}).get("gamma"))


def _weight_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape, from the safetensors headers (no weights read)."""
    shapes = {}
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(weights, framework="numpy") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    return shapes


def _leftovers(path: Path) -> list[str]:
    return sorted(name for name in (*DRAFTOPS_FILES, HF_ASSISTANT_DIR) if (path / name).exists())


def _check_target_vocab(path: Path, vocab: int, target_vocab_size: int | None) -> None:
    # vLLM refuses a draft whose vocab_size differs from the target's
    # (`SpeculativeConfig.verify_equal_vocab_size_if_draft_model`, vllm-project/vllm#24322): a reduced head can only
    # go out as its full-vocabulary copy.
    if target_vocab_size is not None and vocab != target_vocab_size:
        raise ExportError(f"{path}: the draft's vocab_size {vocab} differs from the target's {target_vocab_size}: "
                          "vLLM and SGLang need one vocabulary for both")


def check_hf_folder(path: Path, target_vocab_size: int | None = None) -> int:
    """The vocab_size of the plain checkpoint at `path` once `config.json` and its weights agree on it: embedding rows
    and lm_head rows equal vocab_size, an untied config has an lm_head, and no draftops file is there. ExportError
    otherwise, or when `target_vocab_size` is given and differs."""
    if leftovers := _leftovers(path):
        raise ExportError(f"{path} holds draftops files {leftovers}, which a serving engine would misread")
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config(decoder=True)
    with torch.device("meta"):  # the model's own names for its embeddings and head, without memory for weights
        model = AutoModelForCausalLM.from_config(config)
    names = {module: name for name, module in model.named_modules()}
    embed_name = names[model.get_input_embeddings()] + ".weight"
    head_name = names[model.get_output_embeddings()] + ".weight"
    # vLLM loads the weights by name into a model built from config.json, so vocab_size, the embedding rows and the
    # lm_head rows must agree, and an untied config needs its lm_head.weight.
    shapes, vocab = _weight_shapes(path), text.vocab_size
    if embed_name not in shapes or shapes[embed_name][0] != vocab:
        raise ExportError(f"{path}: config vocab_size {vocab}, embeddings {embed_name} {shapes.get(embed_name)}")
    if head_name in shapes and shapes[head_name][0] != vocab:
        raise ExportError(f"{path}: config vocab_size {vocab}, but {head_name} has {shapes[head_name][0]} rows")
    if head_name not in shapes and not text.tie_word_embeddings:
        raise ExportError(f"{path}: tie_word_embeddings is false and there is no {head_name}")
    _check_target_vocab(path, vocab, target_vocab_size)
    return vocab


def check_speculators_folder(path: Path, target_vocab_size: int | None = None) -> int:
    """The target vocabulary size of the Eagle3 folder at `path` once its config and weights agree: lm_head rows and
    d2t length equal draft_vocab_size, and no draftops file is there. ExportError otherwise, or when
    `target_vocab_size` is given and differs."""
    if leftovers := _leftovers(path):
        raise ExportError(f"{path} holds draftops files {leftovers}, which a serving engine would misread")
    config = json.loads((path / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3" or not (path / WEIGHTS_FILE).is_file():
        raise ExportError(f"{path} is not a speculators eagle3 folder with {WEIGHTS_FILE}")
    shapes, rows = _weight_shapes(path), config.get("draft_vocab_size")
    if shapes.get("lm_head.weight", [None])[0] != rows or shapes.get("d2t", [rows])[0] != rows:
        raise ExportError(f"{path}: draft_vocab_size {rows}, lm_head {shapes.get('lm_head.weight')}, "
                          f"d2t {shapes.get('d2t')}")
    vocab = config["transformer_layer_config"]["vocab_size"]
    _check_target_vocab(path, vocab, target_vocab_size)
    return vocab


def _copy_files(src: Path, dst: Path) -> None:
    """The files of `src` (not its folders), without draftops' own."""
    for item in sorted(src.iterdir()):
        if item.is_file() and item.name not in DRAFTOPS_FILES:
            shutil.copy2(item, dst / item.name)


def _write_full_vocab(draft: DraftSource, tmp: Path) -> None:
    """A layer draft's full-vocabulary checkpoint and tokenizer into the empty folder `tmp`: `hf_assistant/`, the
    checkpoint itself when its head is full, or a copy built from a reduced head (`full_vocab_copy`), whose rows for
    the target ids the reduced head dropped are zero, so they score logit 0."""
    copy_dir = draft.path / HF_ASSISTANT_DIR
    if (copy_dir / "config.json").is_file():
        _copy_files(copy_dir, tmp)
    elif (draft.path / DRAFT_VOCAB_FILE).is_file():
        token_ids = torch.tensor(json.loads((draft.path / DRAFT_VOCAB_FILE).read_text())["token_ids"])
        full_vocab_copy(load_checkpoint(draft.path), token_ids).save_pretrained(tmp)
    else:
        _copy_files(draft.path, tmp)
    if not (tmp / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(draft.path).save_pretrained(tmp)


def target_gguf(target: str) -> Path:
    """The GGUF file of `target` (a named GGUF model or a .gguf path), whose vocabulary a GGUF draft must carry."""
    if target in NAMED_GGUF:
        return named_gguf_path(target)
    path = Path(target).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ExportError(f"the GGUF format takes its vocabulary from the target's GGUF, and {target} is not one: give "
                      "--target FILE.gguf (llama.cpp's convert_hf_to_gguf.py makes one from a checkpoint)")


def check_gguf_file(path: Path, reference: torch.nn.Module, dtype: str) -> None:
    """Read the GGUF at `path` back through transformers' GGUF loader and compare its logits with `reference`'s on
    GGUF_CHECK_TOKENS token ids spread over the vocabulary: equal to float32 rounding for f32, to 1% of the largest
    logit for f16, to 5% for Q8_0 (8-bit weights). ExportError otherwise."""
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    ids = torch.linspace(0, vocab - 1, GGUF_CHECK_TOKENS).long()
    with torch.no_grad():
        want = reference.float()(ids[None]).logits[0]
        got = back(ids[None]).logits[0]
    error, scale = float((want - got).abs().max()), float(want.abs().max())
    if error > {"f32": 1e-4, "f16": 1e-2}.get(dtype, 5e-2) * max(scale, 1.0):
        raise ExportError(f"{path}: read back, its logits differ from the draft's by {error:.3g} (largest {scale:.3g})")


def _write_gguf(draft: DraftSource, tmp: Path, vocabulary: Path, dtype: str) -> None:
    """The layer draft's full-vocabulary copy as `draft-<dtype>.gguf` in `tmp`, checked against the copy."""
    scratch = tmp / ".hf"
    scratch.mkdir()
    _write_full_vocab(draft, scratch)
    model = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()
    gguf_file = tmp / f"draft-{dtype}.gguf"
    try:
        write_llama_gguf(model.state_dict(), model.config, vocabulary, gguf_file, dtype=dtype,
                         name=f"draftops draft of {draft.target or 'its target'}")
    except GGUFExportError as exc:
        raise ExportError(f"{draft.source}: {exc}") from exc
    shutil.rmtree(scratch)
    check_gguf_file(gguf_file, model, dtype)


def _write_eagle3(draft: DraftSource, tmp: Path, target_dir: Path, converter: Path, dtype: str) -> None:
    """The feature draft's speculators folder as `draft-eagle3-<dtype>.gguf` in `tmp`, checked against the folder."""
    gguf_file = tmp / f"draft-eagle3-{dtype}.gguf"
    try:
        write_eagle3_gguf(draft.path, target_dir, gguf_file, converter, dtype=dtype)
        check_eagle3_gguf(gguf_file, draft.path, dtype)
    except GGUFExportError as exc:
        raise ExportError(f"{draft.source}: {exc}") from exc


def export_format(draft: DraftSource, fmt: str, out: Path, *, force: bool = False,
                  target_vocab_size: int | None = None, vocabulary: Path | None = None,
                  gguf_dtype: str = "f16", target_dir: Path | None = None, converter: Path | None = None) -> Path:
    """Write `draft` in format `fmt` (one of FORMATS) to `out`, checked (`check_hf_folder`,
    `check_speculators_folder`, against `target_vocab_size` when given; `check_gguf_file`, `check_eagle3_gguf`),
    beside `out` and swapped in. The GGUF format needs `vocabulary`, the target's GGUF (`target_gguf`), for a layer
    draft, and for a feature draft `target_dir`, the target's Hugging Face folder (tokenizer and config), and
    `converter`, llama.cpp's convert_hf_to_gguf.py (`decode.serving.llamacpp.converter_script`).
    ExportError for a format the draft's family has not, an `out` that is not empty (unless `force`), or one that
    holds the draft."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt not in FORMATS_OF[draft.family]:
        kind = "layer draft" if draft.family == LAYERS else "feature draft (speculators Eagle3 folder)"
        *first, last = FORMATS_OF[draft.family]
        raise ExportError(f"{draft.source} is a {kind}: it exports as {', '.join(first)} or {last}, not {fmt}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.resolve() == draft.path.resolve() or out.resolve() in draft.path.resolve().parents:
        raise ExportError(f"{out} holds the draft itself ({draft.path}): choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (--force replaces it)")
    needs, given = ("the target's Hugging Face folder, llama.cpp's converter", target_dir and converter) if (
        draft.family == FEATURES) else ("the target's GGUF", vocabulary)
    if fmt == GGUF and (given is None or gguf_dtype not in GGUF_DTYPES):
        raise ExportError(f"the GGUF format needs {needs} and a dtype in {', '.join(GGUF_DTYPES)}")
    tmp = temporary_sibling(out)
    tmp.mkdir()
    try:
        if draft.family == FEATURES and fmt == GGUF:
            _write_eagle3(draft, tmp, target_dir, converter, gguf_dtype)
        elif draft.family == FEATURES:
            _copy_files(draft.path, tmp)
            check_speculators_folder(tmp, target_vocab_size)
        elif fmt == GGUF:
            _write_gguf(draft, tmp, vocabulary, gguf_dtype)
        else:
            _write_full_vocab(draft, tmp)
            check_hf_folder(tmp, target_vocab_size)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return swap_dir(tmp, out)


def folder_vocab_size(source: str) -> int | None:
    """The vocab_size in the config.json of `source` when it is a local folder (a target), else None."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return None
    return AutoConfig.from_pretrained(config.parent).get_text_config(decoder=True).vocab_size


def serving_commands(family: str, fmt: str, out: Path, target: str, gamma: int) -> list[str]:
    """The lines to print after an export: how vLLM, SGLang (and for `hf` transformers) take the folder `out` beside
    `target`, proposing `gamma` tokens a round, marked as not run here; for `gguf`, llama-server's command line."""
    folder = str(Path(out).resolve())
    if fmt == GGUF:
        drafts = sorted(Path(folder).glob("*.gguf"))
        kind = "draft-simple" if family == LAYERS else "draft-eagle3"
        try:
            served = shlex.quote(str(target_gguf(target)))
        except ExportError:  # an EAGLE-3 draft is made beside the target's folder; llama.cpp serves its GGUF
            served = "TARGET.gguf"
        return ["Serve it with llama.cpp (`draftops llama-cpp build` builds llama-server on this machine):",
                f"  llama-server -m {served} -md {shlex.quote(str(drafts[0]))} "
                f"--spec-type {kind} --spec-draft-n-max {gamma} --spec-draft-n-min 0 --metrics",
                *(["  (`draftops bench` runs llama.cpp's target alone and with this draft beside draftops' rows)"]
                  if family == LAYERS else [])]
    method, algorithm = ("draft_model", "STANDALONE") if family == LAYERS else ("eagle3", "EAGLE3")
    spec = json.dumps({"model": folder, "method": method, "num_speculative_tokens": gamma})
    # SGLang's EAGLE-3 examples use SpecForge's layout; that it reads the speculators config schema is not
    # established, and no engine runs on the CPU machines these folders are made on: the lines say so.
    lines = ["Serve it (commands from the vLLM and SGLang docs, not tested on this CPU machine):",
             f"  vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"]
    if family == FEATURES:
        lines.append(f"  vllm serve {shlex.quote(folder)}   # the target named in its speculators_config")
    lines.append(f"  python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm "
                 f"{algorithm} --speculative-draft-model-path {shlex.quote(folder)} --speculative-num-steps {gamma} "
                 f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma + 1}")
    if fmt == HF:
        lines.append(f"  transformers: target.generate(..., assistant_model="
                     f"AutoModelForCausalLM.from_pretrained({folder!r}))")
    if not Path(target).expanduser().is_dir():
        lines.append(f"  ({target} is not a local folder: give the engines the target's Hugging Face checkpoint or "
                     f"hub id; `draftops models info {target}` prints its local path)")
    return lines
