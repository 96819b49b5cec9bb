"""The drafts a sweep compares: registered or local draft models, `target-layers:N[:V]` (the target's own first N
layers, optionally with a reduced head) and prompt lookup, each measured alone at fixed γ."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafters.chain import make_drafter
from decode.drafters.lookup import PROMPT_LOOKUP
from decode.drafters.protocol import DRAFT, LOOKUP, Drafter
from decode.factory import model_decoder
from decode.models.feature_draft import FeatureDraft
from decode.models.layer_draft import draft_from_target_layers, frequent_token_ids, reduce_vocabulary
from decode.runtime.kernels import cpu_linear_of, use_cpu_linear
from decode.serving.loading import load_draft
from decode.speculative import SpeculativeDecoder
from pipeline.sources import SourceError

TARGET_LAYERS = "target-layers:"  # `target-layers:N[:V]`: the target's first N layers, embeddings, norm and head


@dataclass
class Draft:
    """A swept draft: a model (with optional reduced vocabulary), or prompt lookup when `model` is None. The sweep
    measures each alone at fixed γ, without lookup or a confidence stop."""

    name: str
    model: torch.nn.Module | None
    token_ids: torch.Tensor | None = None

    @property
    def is_model(self) -> bool:
        return self.model is not None

    @property
    def grows_trees(self) -> bool:
        """A draft LM: what `decode.drafters.tree_drafter.ModelTree` grows trees with (not prompt lookup, not a feature
        draft)."""
        return self.is_model and not isinstance(self.model, FeatureDraft)

    def drafter(self, target_model) -> Drafter:
        return make_drafter(DRAFT if self.is_model else LOOKUP, target_model, self.model,
                            draft_token_ids=self.token_ids)

    def decoder(self, target_model, gamma: int) -> SpeculativeDecoder:
        """This draft alone at a fixed γ in chain rounds, greedy, never stopping at EOS (the sweep times fixed
        lengths): what the sweep's measured cells run."""
        return model_decoder(target_model, self.drafter(target_model), gamma, eos_token_ids=())


def load_drafts(sources: Sequence[str], target, notes: list[str], vocab_texts: Sequence[list[int]] = ()) -> list[Draft]:
    """Draft sources: `prompt-lookup`, `target-layers:N[:V]`, or any model source; a trailing `?` makes one optional.
    A model source that is the same checkpoint as an earlier one (two aliases of one registered version: by
    fingerprint) is swept once, under the earlier name, with a note.

    `target-layers:N:V` keeps V rows of the head: the V most frequent ids in vocab_texts (token id lists, e.g. the
    traffic's prompts) plus the special tokens. target is a `pipeline.sources.ResolvedModel`; drafts land on its
    device and dtype.
    """

    parameter, kernels = next(target.model.parameters()), cpu_linear_of(target.model)
    drafts, fingerprints = [], {}
    for source in sources:
        name = source.rstrip("?")
        if name == PROMPT_LOOKUP:
            drafts.append(Draft(name, None))
        elif name.startswith(TARGET_LAYERS):
            n_layers, _, vocab = name[len(TARGET_LAYERS):].partition(":")
            model = draft_from_target_layers(target.model, list(range(int(n_layers)))).to(parameter.device)
            token_ids = None
            if vocab:
                if not vocab_texts:
                    raise ValueError(f"{name}: a reduced head needs token texts to count")
                token_ids = frequent_token_ids(vocab_texts, int(vocab), target.tokenizer.all_special_ids)
                reduce_vocabulary(model, token_ids, target.model.get_output_embeddings().weight.detach())
            drafts.append(Draft(name, use_cpu_linear(model.eval(), kernels), token_ids))
        else:
            try:
                resolved = load_draft(name, target, cpu_linear=kernels)
            except SourceError as exc:
                if not source.endswith("?"):
                    raise
                notes.append(f"optional draft {name} skipped: {exc}")
                continue
            if resolved.fingerprint in fingerprints:
                notes.append(f"{name} is the same draft as {fingerprints[resolved.fingerprint]}: swept once")
                continue
            fingerprints[resolved.fingerprint] = name
            drafts.append(Draft(name, resolved.model, resolved.token_ids))
    if not drafts:
        raise ValueError("no drafts to sweep")
    return drafts
