"""Drafts made elsewhere (`draftops models import`): an EAGLE-3 head checked against the target and written as a
draftops feature draft folder, which registration, `monitor check`, the engine counters, bench and export then read as
they read a distilled one.

Two layouts are read. A speculators Eagle3 folder: `config.json` with `speculators_config` and
`eagle_aux_hidden_state_layer_ids`, `model.safetensors` with `fc`, `layers.0.*`, `norm`, `lm_head` and a reduced head's
`d2t`/`t2d` (what speculators trains, vLLM serves and `decode.serving.speculators` writes). EAGLE's own checkpoint
(SafeAILab/EAGLE, EAGLE-3): a Llama `config.json` with `draft_vocab_size`, and `fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d` in `model.safetensors`; speculators' own converter (`speculators.convert.eagle.Eagle3Converter`) turns it
into the first, reading EAGLE-3's layers 2, L/2 and L-3 of the target. A `pytorch_model.bin` alone is refused:
unpickling it runs whatever code it holds.

Before anything is allocated for it, the folder is checked by `decode.serving.head_checks` (symlinks inside it, the
safetensors header read alone, config sizes within bounds from the target, tensor shapes, d2t/t2d ranges, finite
weights). The head is then checked against the target by `decode.serving.speculators.load_speculators` (hidden size,
the layers it reads, the vocabulary map: `t2d` over the target's vocabulary and `d2t` naming the same ids) and, where
the head carries a tokenizer or names a local verifier folder with one, by `pipeline.sources.check_tokenizer_compat`.
The folder written holds the head in the speculators format for the target as this machine loads it, the draftops
config (its target and γ) and `imported.json`, where it came from.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from decode.models.feature_draft import FeatureDraft, default_feature_layers
from decode.serving.head_checks import HeadCheckError, check_head, check_inside, safetensors_header
from decode.serving.speculators import WEIGHTS_FILE, load_speculators, save_speculators
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig, save_config
from pipeline.files import swap_dir, temporary_sibling
from pipeline.sources import CONFIG_FILE, ResolvedModel, check_tokenizer_compat, is_speculators_dir
from pipeline.tracking import git_sha, start_run

SPECULATORS, EAGLE = "speculators", "eagle"  # the layouts read
PROVENANCE_FILE = "imported.json"
PICKLE = "pytorch_model.bin"
EAGLE_KEYS = ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight")  # what marks EAGLE-3's own layout


class HeadImportError(ValueError):
    """A folder that is not a head draftops can import, or one that does not fit the target."""


@dataclass
class ImportedDraft:
    """A head written by `import_head`: its folder, where it came from, its layout, the verifier it names, the
    model, and the checks it passed (in words)."""

    path: Path
    source: str
    layout: str
    verifier: str
    draft: FeatureDraft
    checks: list[str] = field(default_factory=list)


def head_layout(path: Path) -> str:
    """SPECULATORS or EAGLE for a folder of either layout; HeadImportError in one line for anything else."""
    if not (path / "config.json").is_file():
        raise HeadImportError(f"{path}: no config.json (a speculators Eagle3 folder or an EAGLE-3 checkpoint has one)")
    if not (path / WEIGHTS_FILE).is_file():
        if (path / PICKLE).is_file():
            raise HeadImportError(f"{path}: only {PICKLE}, a pickle that runs code when loaded; save its tensors as "
                               f"{WEIGHTS_FILE} (safetensors) and import that")
        raise HeadImportError(f"{path}: no {WEIGHTS_FILE}")
    if is_speculators_dir(path):
        return SPECULATORS
    try:
        names = set(safetensors_header(path / WEIGHTS_FILE))  # the header alone, checked
    except HeadCheckError as exc:
        raise HeadImportError(str(exc)) from None
    if all(key in names for key in EAGLE_KEYS):
        return EAGLE
    raise HeadImportError(f"{path}: neither a speculators Eagle3 folder (config.json naming speculators_model_type) "
                       "nor an EAGLE-3 checkpoint (fc, midlayer.*, lm_head)")


def convert_eagle(path: Path, out: Path, target: ResolvedModel) -> Path:
    """EAGLE's own checkpoint at `path` as a speculators Eagle3 folder `out`, by speculators' converter, for the
    target's Hugging Face folder (its vocabulary and context length), reading EAGLE-3's default layers."""
    from speculators.convert.eagle import Eagle3Converter

    layers = list(default_feature_layers(target.model.config.get_text_config(decoder=True).num_hidden_layers))
    try:
        Eagle3Converter().convert(path, out, base_model=str(target.path), validate=False,
                                  eagle_aux_hidden_state_layer_ids=layers)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise HeadImportError(f"{path}: speculators' EAGLE-3 converter failed: {exc}") from exc
    return out


def tokenizer_checks(path: Path, verifier: str, target: ResolvedModel) -> list[str]:
    """Check the tokenizer the head carries, or its verifier's where that is a local folder, against the target's
    (`check_tokenizer_compat`); the words for what was checked."""
    for folder, what in ((path, "the head's own tokenizer"), (Path(verifier), f"its verifier {verifier}'s tokenizer")):
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            check_tokenizer_compat(target.tokenizer, AutoTokenizer.from_pretrained(folder))
            return [f"{what} maps text to the target's ids"]
    return [f"no tokenizer to compare: the head carries none and its verifier {verifier or '(unnamed)'} is not a "
            "local folder; its vocabulary size is the target's"]


def verifier_of(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return str((config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or "")


def import_head(source: str | Path, target: ResolvedModel, out: Path, cfg: DraftopsConfig) -> ImportedDraft:
    """The head at `source` checked against `target` and written to `out` (beside it, then swapped in): the
    speculators folder for `target`, `cfg` (its target and γ) and the provenance file. HeadImportError when it does not
    fit."""
    path = Path(source)
    if not path.is_dir():
        raise HeadImportError(f"{source}: not a folder (a speculators Eagle3 folder or an EAGLE-3 checkpoint)")
    try:
        check_inside(path)
    except HeadCheckError as exc:
        raise HeadImportError(str(exc)) from None
    layout = head_layout(path)
    with tempfile.TemporaryDirectory(prefix="draftops-import-") as scratch:
        folder = convert_eagle(path, Path(scratch) / "speculators", target) if layout == EAGLE else path
        verifier = verifier_of(path) if layout == SPECULATORS else ""
        try:
            check_head(folder, target.model.config.get_text_config(decoder=True))  # before anything is allocated
            draft = load_speculators(folder, target.model)
            checks = tokenizer_checks(path, verifier, target)
        except ValueError as exc:
            raise HeadImportError(f"{source}: {exc}") from exc
    checks.insert(0, f"hidden size {draft.config.hidden_size}, reads target layers {list(draft.feature_layers)}, "
                     + (f"head over {len(draft.token_ids)} of the target's {draft.config.vocab_size} ids (d2t/t2d)"
                        if draft.token_ids is not None else f"full head of {draft.config.vocab_size} ids"))
    tmp = temporary_sibling(out)
    save_speculators(draft, tmp, verifier_name_or_path=str(target.path), speculative_tokens=cfg.decode.gamma)
    save_config(cfg, tmp / CONFIG_FILE)
    (tmp / PROVENANCE_FILE).write_text(json.dumps({"source": str(source), "layout": layout, "verifier": verifier},
                                                  indent=1) + "\n")
    return ImportedDraft(swap_dir(tmp, out), str(source), layout, verifier, draft, checks)


def register_import(cfg: DraftopsConfig, imported: ImportedDraft, target: ResolvedModel, *,
                    alias: str | None = None) -> tuple[str, str]:
    """An MLflow run in `draftops-import` that registers the imported folder as a version of the configured model,
    with its provenance in tags (`pipeline.metrics.IMPORTED_FROM_TAG`, ...; `draftops.source` says import, not
    distill) and the target it was checked against: champion when the model has none, else challenger (or `alias`),
    as `pipeline.registry.register` decides. Returns (version, alias)."""
    lineage = {M.TARGET_FINGERPRINT_TAG: target.fingerprint, M.TARGET_SOURCE_TAG: cfg.target}
    provenance = {M.VERSION_SOURCE_TAG: "import", M.IMPORTED_FROM_TAG: imported.source,
                  M.IMPORT_LAYOUT_TAG: imported.layout, M.IMPORT_VERIFIER_TAG: imported.verifier or "-"}
    with start_run(cfg, "import", run_name=f"import-{Path(imported.source).name}", tags=lineage | provenance):
        description = "\n".join([
            f"Feature draft (EAGLE-3) imported from `{imported.source}` ({imported.layout} layout"
            + (f", trained for `{imported.verifier}`" if imported.verifier else "") + "), not distilled by draftops.",
            f"Checked against `{cfg.target}` (target fingerprint `{target.fingerprint}`):", "",
            *[f"- {check}" for check in imported.checks]])
        version, alias = registry.register(
            imported.path, cfg.tracking.registered_model, description=description, alias=alias,
            tags={**lineage, **provenance, M.GIT_SHA_TAG: git_sha(), M.GAMMA_TAG: str(cfg.decode.gamma)},
            lock_timeout=cfg.tracking.lock_timeout)
    return str(version.version), alias
