"""The one place decoders are built. `build_decoder` builds the decoder `cfg.decode` describes, sampling settings and
length included: the decode CLI, eval, bench and its rows and the monitor's live measurement all call it, so a config
means the same decoder everywhere. `model_decoder` builds one from a draft model (or a drafter) and explicit settings:
the sweep's fixed-γ cells, and tests."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from decode.drafters.chain import make_drafter
from decode.drafters.protocol import DECODER, DRAFT, LOOKUP, SUFFIX
from decode.drafters.suffix import SuffixIndex, load_suffix_index
from decode.drafters.tree_drafter import make_tree_drafter
from decode.runtime.forward import ModelRunner
from decode.runtime.lean import build_compiled_graphs, compiled_lean, lean_problem, notice_fallback, use_compiled_passes
from decode.speculative import GREEDY, GammaPolicy, Sampling, SpeculativeDecoder
from decode.tree_budget_measured import BudgetChoice, DecoderChoice, TextTrees, choose_trees
from pipeline.config import AUTO, DecodeConfig
from pipeline.sources import eos_token_ids as target_eos_ids


def gamma_policy(decode: DecodeConfig, gamma: int | None = None) -> GammaPolicy:
    """The config's γ policy; an explicit `gamma` (e.g. `--gamma`) asks for that fixed γ instead."""
    if gamma is not None:
        return GammaPolicy("fixed", gamma)
    if decode.gamma_policy == "schedule":
        return GammaPolicy.scheduled(decode.gamma_schedule)
    return GammaPolicy(decode.gamma_policy, decode.gamma)


def build_decoder(target, draft, decode: DecodeConfig, *, kind: str = DECODER, gamma: int | None = None,
                  lean: bool = True) -> SpeculativeDecoder:
    """The speculative decoder `decode` describes, with the drafter of `kind` (`decode.drafters.chain.DRAFTER_KINDS`,
    and in tree rounds `TREE_DRAFTER_KINDS`).

    target: a `pipeline.sources.ResolvedModel` (its generation config and tokenizer give the EOS ids); draft: one too,
    or None for the "lookup" and "suffix" drafters. `decode.tree_budget` > 0 or `decode.tree_budget_schedule` gives
    tree rounds (`decode.drafters.tree_drafter`) with the drafters and budgets of `tree_drafters`;
    `decode.drafters.suffix` adds suffix decoding to the trees of "decoder" and "lookup", with the suffix index of
    `suffix_index_of`.
    `decode.compiled` compiles the target's and a layer draft's passes (`decode.runtime.lean.use_compiled_passes`: for
    every decoder of them in this process).
    """
    draft_model, token_ids = (None, None) if draft is None else (draft.model, draft.token_ids)
    if decode.compiled and lean:  # before the tree budget's costs are timed: they are the compiled passes'
        compile_where_supported(target.model)
        if hasattr(draft_model, "config") and lean_problem(draft_model) is None:  # a layer draft (a feature one: eager)
            use_compiled_passes(draft_model)
    compiled = lean and compiled_lean(target.model) is not None  # by this decoder or an earlier one in this process
    runner = ModelRunner(target.model, lean)  # the decoder's target forward, built once here
    lookup_min_ngram = decode.lookup_min_ngram if kind in (DECODER, LOOKUP) else None
    suffix = (decode.suffix and kind in (DECODER, LOOKUP)) or kind == SUFFIX
    if decode.tree_rounds:
        choice = tree_drafters(decode, target, draft, kind, compiled=compiled)
        drafter = make_tree_drafter(kind if choice is None else choice.kind, target.model, draft_model,
                                    budget=decode.tree_budget,
                                    budget_schedule=None if choice is None else choice.budget.schedule,
                                    branching=decode.tree_branching,
                                    draft_token_ids=token_ids, lookup_min_ngram=lookup_min_ngram, suffix=suffix,
                                    suffix_index=suffix_index_of(decode, draft) if suffix else None,
                                    draft_min_confidence=decode.draft_min_confidence,
                                    draft_rerank=decode.tree_rerank, lean=lean)
    else:
        drafter = make_drafter(kind, target.model, draft_model, draft_token_ids=token_ids,
                               lookup_min_ngram=lookup_min_ngram, draft_min_confidence=decode.draft_min_confidence,
                               lean=lean)
    if compiled:  # every graph its rounds can need, now rather than in the middle of a request
        build_compiled_graphs(target.model, drafter.feature_layers)
        build_compiled_graphs(draft_model)
    eos = target_eos_ids(target.model, target.tokenizer)
    return SpeculativeDecoder(runner, drafter, gamma_policy(decode, gamma), eos_token_ids=eos,
                              sampling=sampling_of(decode))


def sampling_of(decode: DecodeConfig) -> Sampling:
    """The config's length and sampling settings, as a decoder's defaults."""
    return Sampling(decode.max_new_tokens, decode.temperature, decode.top_k, decode.top_p)


def model_decoder(target, draft, gamma: int | GammaPolicy = 5, *, draft_token_ids: torch.Tensor | None = None,
                  lookup_min_ngram: int | None = None, draft_min_confidence: float | None = None,
                  tree_budget: int = 0, tree_branching: int = 2, lean: bool = True,
                  eos_token_ids: Sequence[int] | int | None = None, sampling: Sampling = GREEDY,
                  stop_strings: Sequence[str] | None = None, tokenizer=None) -> SpeculativeDecoder:
    """A decoder of the HF causal LM `target` with `draft`: a draft model (the "decoder" drafter of `make_drafter`,
    or of `make_tree_drafter` with `tree_budget` > 0: prompt lookup first where `lookup_min_ngram` is set, the model
    ending its block below `draft_min_confidence`) or a drafter as it is. eos_token_ids None: the target's generation
    config's EOS ids; () never stops."""
    if isinstance(draft, torch.nn.Module) and tree_budget:
        draft = make_tree_drafter(DECODER, target, draft, budget=tree_budget, branching=tree_branching,
                                  draft_token_ids=draft_token_ids, lookup_min_ngram=lookup_min_ngram,
                                  draft_min_confidence=draft_min_confidence, lean=lean)
    elif isinstance(draft, torch.nn.Module):
        draft = make_drafter(DECODER, target, draft, draft_token_ids=draft_token_ids,
                             lookup_min_ngram=lookup_min_ngram, draft_min_confidence=draft_min_confidence, lean=lean)
    elif tree_budget or any(x is not None for x in (draft_token_ids, lookup_min_ngram, draft_min_confidence)):
        raise ValueError("draft_token_ids, lookup_min_ngram, draft_min_confidence and tree_budget apply to draft "
                         "models only")
    if eos_token_ids is None:
        eos_token_ids = target_eos_ids(target, tokenizer)
    elif isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    return SpeculativeDecoder(ModelRunner(target, lean), draft, gamma, eos_token_ids=eos_token_ids,
                              sampling=sampling, stop_strings=stop_strings, tokenizer=tokenizer)


def compile_where_supported(model) -> bool:
    """`decode.compiled` for `model`: its passes compiled where the lean forward runs its architecture
    (`decode.runtime.lean.use_compiled_passes`), else run eagerly through transformers' forward, said once per model
    on stderr (`decode.runtime.lean.notice_fallback`). Returns whether they are compiled."""
    if lean_problem(model) is None:
        use_compiled_passes(model)
        return True
    notice_fallback(model, compiled=True)
    return False


def tree_drafters(decode: DecodeConfig, target, draft, kind: str = DECODER, *,
                  compiled: bool = False) -> DecoderChoice | None:
    """The tree drafter kind `decode`'s tree rounds build for `kind`, and its node budget schedule, "auto" resolved
    (`decode.tree_budget_measured.choose_trees`: from the draft's rank acceptance where its model grows the tree,
    from prompt lookup's and suffix decoding's trees replayed on the suffix index of `suffix_index_of` where they
    grow it). Under `decode.use_draft: auto` the default decoder's draft model competes with the decoder's trees
    without it and is left out where it does not pay on this machine; a measured choice is said once per process on
    stderr. compiled: whether the target's passes are compiled (its costs are those passes'). None for a fixed
    `tree_budget` or chain rounds."""
    schedule = decode.tree_budget_schedule
    if decode.tree_budget or schedule is None:
        return None
    if schedule != AUTO:
        return DecoderChoice(kind, BudgetChoice([tuple(e) for e in schedule], "configured"), {}, "")
    choice = choose_trees(target, draft if kind in (DECODER, DRAFT) else None, text_trees_of(decode, draft, kind),
                          decode.gamma, draft_kind=kind, compiled=compiled)
    if len(choice.predicted) > 1 and choice.reason not in _said:  # a measured choice between candidates
        _said.add(choice.reason)
        print(f"decoder drafters auto: {choice.reason} (decode.use_draft=always keeps the draft)", file=sys.stderr,
              flush=True)
    return choice


def text_trees_of(decode: DecodeConfig, draft, kind: str) -> TextTrees | None:
    """The trees without a draft model that `tree_drafters` weighs for `kind`: prompt lookup's or suffix decoding's
    own; for the default decoder under `decode.use_draft: auto`, its trees without the draft (lookup's and suffix
    decoding's, or suffix decoding's where lookup is off); None where there are none to weigh."""
    if kind in (LOOKUP, SUFFIX):
        return TextTrees(kind, suffix_index_of(decode, draft), suffix=decode.suffix or kind == SUFFIX,
                              lookup_min_ngram=decode.lookup_min_ngram if kind == LOOKUP else None,
                              branching=decode.tree_branching)
    without = LOOKUP if decode.lookup_min_ngram is not None else SUFFIX if decode.suffix else None
    if kind != DECODER or draft is None or without is None or decode.use_draft != AUTO:
        return None
    return TextTrees(without, suffix_index_of(decode, draft), suffix=decode.suffix,
                          lookup_min_ngram=decode.lookup_min_ngram, branching=decode.tree_branching)


_said: set[str] = set()  # the drafter choices already said in this process


def suffix_index_of(decode: DecodeConfig, draft) -> SuffixIndex | None:
    """The suffix index suffix decoding searches: `decode.suffix_index` when set, else the one the draft's folder
    carries (`decode.drafters.suffix.load_suffix_index`); None (the request alone) when there is neither."""
    if decode.suffix_index is not None:
        if not Path(decode.suffix_index).is_file():
            raise ValueError(f"decode.suffix_index: no file {decode.suffix_index}")
        return SuffixIndex.load(decode.suffix_index)
    return load_suffix_index(draft.path) if draft is not None and draft.path is not None else None
