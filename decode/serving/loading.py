"""Loading models to decode with: a target or draft from any source (`pipeline.sources`), its linear layers on the
CPU kernels `cpu_linear` picks; a feature draft from the speculators format; the draft as HF assisted generation
takes it."""
from __future__ import annotations

import torch

from decode.runtime.kernels import cpu_linear_of, use_cpu_linear
from decode.serving.speculators import load_speculators
from pipeline.sources import (
    HF_ASSISTANT_DIR,
    ResolvedModel,
    SourceError,
    check_tokenizer_compat,
    is_speculators_dir,
    load_checkpoint,
    locate,
    resolve_model,
)


def load_model(source: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               cpu_linear: str = "auto") -> ResolvedModel:
    """`pipeline.sources.resolve_model` with the model's linear layers on `cpu_linear` kernels, ready to decode
    ("auto": measured once per machine and weight shape, `decode.runtime.kernels.use_cpu_linear`)."""
    resolved = resolve_model(source, device=device, dtype=dtype)
    use_cpu_linear(resolved.model, cpu_linear)
    return resolved


def load_draft(source: str, target: ResolvedModel, *, cpu_linear: str = "auto") -> ResolvedModel:
    """A draft for `target`, on its device and in its dtype: a draft LM (`load_model`, its tokenizer checked against
    the target's), or a feature draft in the speculators format (`decode.serving.speculators`), which reads the
    target's embeddings and features and so is built over the loaded target (its tokenizer is the target's)."""
    local = locate(source)
    if is_speculators_dir(local.path):
        try:
            draft = load_speculators(local.path, target.model)
        except ValueError as exc:
            raise SourceError(f"{source}: {exc}") from exc
        use_cpu_linear(draft, cpu_linear)
        return ResolvedModel(source, local.path, draft.eval(), target.tokenizer, local.fingerprint, None)
    parameter = next(target.model.parameters())
    draft = load_model(source, device=parameter.device, dtype=parameter.dtype, cpu_linear=cpu_linear)
    check_tokenizer_compat(target.tokenizer, draft.tokenizer)
    return draft


def hf_assistant_model(draft: ResolvedModel) -> torch.nn.Module:
    """The draft as transformers' assisted generation can use it: the model itself, or the full-vocabulary copy that a
    reduced-vocabulary draft carries in `hf_assistant/`."""
    if draft.token_ids is None:
        return draft.model
    copy_dir = draft.path / HF_ASSISTANT_DIR
    if not (copy_dir / "config.json").exists():
        raise SourceError(
            f"{draft.source}: reduced-vocabulary draft without a full-vocabulary {HF_ASSISTANT_DIR}/ copy")
    parameter = next(draft.model.parameters())
    copy = load_checkpoint(copy_dir, dtype=parameter.dtype).to(parameter.device).eval()
    return use_cpu_linear(copy, cpu_linear_of(draft.model))
