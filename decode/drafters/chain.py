"""Chain drafters: the draft model's (`ModelDrafter`), and `make_drafter`, which builds each kind of
`decode.drafters.protocol.DRAFTER_KINDS`."""
from __future__ import annotations

import torch
from transformers import DynamicCache

from decode.drafters.lookup import LookupThenModelDrafter, PromptLookupDrafter, lookup_first_drafter
from decode.drafters.protocol import DECODER, DRAFT, DRAFTER_KINDS, LOOKUP, SUFFIX, Drafter
from decode.models.feature_draft import FeatureDraft, FeatureDrafter
from decode.runtime.forward import ModelRunner, rollback
from decode.sampling import Warp, confident, draft_token


def model_context(model) -> int | None:
    """The positions a causal LM can attend to (None if its config does not say)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def output_size(model) -> int:
    """Rows of the model's output head: its vocabulary, or a reduced draft vocabulary."""
    return model.get_output_embeddings().weight.shape[0]


class ModelDrafter:
    """A draft LM proposing tokens autoregressively through its own KV cache (the drafter the decoder wraps)."""

    feature_layers = ()

    def __init__(self, draft, vocab_size: int, device: torch.device, *, token_ids: torch.Tensor | None = None,
                 min_confidence: float | None = None, lean: bool = True):
        """min_confidence: end a block at the first draft token after the first whose top probability is below this
        (`confident`); lean: see `ModelRunner`."""
        if next(draft.parameters()).device != device:
            raise ValueError(f"target is on {device} but draft on {next(draft.parameters()).device}")
        draft_size = output_size(draft)
        draft_inputs = draft.get_input_embeddings().num_embeddings
        if draft_inputs < vocab_size:
            raise ValueError(
                f"vocab mismatch: draft embeds {draft_inputs} token ids but the target emits {vocab_size}"
            )
        if token_ids is None:
            if draft_size != vocab_size:
                raise ValueError(
                    f"vocab mismatch: draft predicts {draft_size} tokens, target {vocab_size}; "
                    "pass draft_token_ids for a reduced-vocab draft"
                )
        else:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long)
            if token_ids.ndim != 1 or token_ids.numel() != draft_size:
                raise ValueError(
                    f"vocab mismatch: draft predicts {draft_size} tokens but draft_token_ids has "
                    f"{token_ids.numel()} entries"
                )
            if not bool((token_ids[1:] > token_ids[:-1]).all()) or not (
                0 <= int(token_ids[0]) and int(token_ids[-1]) < vocab_size
            ):
                raise ValueError(f"draft_token_ids must be sorted, unique and inside [0, {vocab_size})")
            token_ids = token_ids.to(device)
        self.model, self.vocab_size, self.device = draft, vocab_size, device
        self.token_ids, self.min_confidence = token_ids, min_confidence
        self.context = model_context(draft)
        self.runner = ModelRunner(draft, lean)
        self.name = DRAFT if min_confidence is None else f"{DRAFT}(min_confidence={min_confidence:g})"

    def start(self, prompt: list[int]):
        """The draft's cache after every prompt token but the last."""
        cache = self.runner.new_cache()
        if len(prompt) > 1:
            self.runner.forward(torch.tensor(prompt[:-1], device=self.device), cache, 0, True)
        return cache

    def propose(self, cache: DynamicCache, seq: list[int], k: int, warp: Warp, generator):
        """Up to k drafts, feeding the draft the tokens it has not seen yet.

        Returns (drafts [k'], q [k', V] on the target vocab, number of draft forwards); q is None when greedy: the
        greedy test reads the drafts only, so a one-hot scattered over the target vocabulary per draft is not built.
        """
        unseen = torch.tensor(seq[cache.get_seq_length() :], device=self.device)
        drafts, probs, calls = [], [], 0
        for i in range(k):
            logits = self.runner.forward(unseen, cache, len(seq) - unseen.shape[0] + i, True)[-1]
            calls += 1
            if i > 0 and self.min_confidence is not None and not confident(logits, self.min_confidence):
                break
            token, q = draft_token(logits, warp, self.token_ids, self.vocab_size, generator)
            probs += [] if q is None else [q]
            drafts.append(token)
            unseen = token[None]
        if warp.greedy:
            q = None
        else:
            q = torch.stack(probs) if probs else torch.empty(0, self.vocab_size, device=self.device)
        if not drafts:
            return torch.empty(0, dtype=torch.long, device=self.device), q, calls
        return torch.stack(drafts), q, calls

    def rollback(self, cache: DynamicCache, length: int) -> None:
        rollback(cache, length)



def make_drafter(kind: str, target, draft=None, *, draft_token_ids: torch.Tensor | None = None,
                 lookup_min_ngram: int | None = None, draft_min_confidence: float | None = None,
                 lean: bool = True) -> Drafter:
    """The drafter of `kind` (see the module docstring) for `target` (an HF causal LM) and `draft` (a draft LM; not
    needed for "lookup"). `lookup_min_ngram` applies to "decoder" (None: no lookup; "lookup" alone matches n-grams of
    1-3 tokens unless it is set), `draft_min_confidence` to the draft model."""
    if kind == SUFFIX:
        raise ValueError("the suffix drafter runs in tree rounds: set decode.tree_budget "
                         "(docs/concepts.md#token-trees)")
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter kind must be one of {DRAFTER_KINDS}, got {kind!r}")
    vocab_size, device = output_size(target), next(target.parameters()).device
    if kind == LOOKUP:
        if lookup_min_ngram is None:
            return PromptLookupDrafter(vocab_size, device)
        return lookup_first_drafter(vocab_size, device, lookup_min_ngram)
    if draft is None:
        raise ValueError(f"the {kind!r} drafter needs a draft model")
    if isinstance(draft, FeatureDraft):
        if draft_token_ids is not None:
            raise ValueError("a feature draft carries its own vocabulary: pass no draft_token_ids")
        model = FeatureDrafter(draft, vocab_size, device, min_confidence=draft_min_confidence)
    else:
        model = ModelDrafter(draft, vocab_size, device, token_ids=draft_token_ids,
                             min_confidence=draft_min_confidence, lean=lean)
    if kind == DECODER and lookup_min_ngram is not None:
        return LookupThenModelDrafter(lookup_first_drafter(vocab_size, device, lookup_min_ngram), model)
    return model
