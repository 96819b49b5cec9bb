"""Which rows `draftops bench` runs: the configured decoder, each of its sources alone, chains beside trees, a
challenger draft's rows and --compare rows, each a decoder the factory builds from its own decode settings."""

from __future__ import annotations

from decode.drafters.protocol import DECODER, DRAFT, LOOKUP, SUFFIX
from decode.factory import tree_drafters
from decode.measure.bench_llamacpp import LLAMA_CPP_SPECULATIVE, LLAMA_CPP_TARGET_ONLY
from decode.runtime.lean import compiled_lean
from pipeline.config import DecodeConfig

TARGET_ONLY, TARGET_ONLY_TORCH = "target_only", "target_only_torch"  # the two baselines; the faster is the denominator
CHAIN, DRAFT_ONLY_CHAIN = "chain", "draft_only_chain"
PLAIN_EAGER = "plain_eager"
SOURCE_ROWS = {DRAFT: "draft_only", LOOKUP: "lookup_only", SUFFIX: "suffix_only"}  # a source's row: it alone
# --challenger: a second draft's rows, each the row of the draft it stands in for
CHALLENGER_ROWS = {"speculative": "challenger", SOURCE_ROWS[DRAFT]: "challenger_draft_only",
                   DRAFT_ONLY_CHAIN: "challenger_draft_only_chain"}


def reserved_rows() -> set[str]:
    """Row names bench gives its own rows: a --compare row takes another."""
    return {TARGET_ONLY, TARGET_ONLY_TORCH, "plain", PLAIN_EAGER, "speculative", "hf_assisted", "hf_prompt_lookup",
            CHAIN, DRAFT_ONLY_CHAIN, *SOURCE_ROWS.values(), *CHALLENGER_ROWS.values(), LLAMA_CPP_TARGET_ONLY,
            LLAMA_CPP_SPECULATIVE}


def decoder_rows(decode: DecodeConfig, has_draft: bool) -> dict[str, tuple[DecodeConfig, str]]:
    """The decoders bench runs, by row name, as (decode settings, drafter kind): `speculative` (the configured
    decoder); when it has more than one source, each source alone (`SOURCE_ROWS`); with trees, the same decoder in
    chain rounds (`chain`) and the draft model alone in chain rounds (`draft_only_chain`), so trees and chains are
    compared in one run."""
    sources = ([LOOKUP] if decode.lookup_min_ngram is not None or not has_draft else []) + \
        ([SUFFIX] if decode.suffix_decoding else []) + ([DRAFT] if has_draft else [])
    rows = {"speculative": (decode, DECODER if has_draft else LOOKUP)}
    if len(sources) > 1:
        alone = decode.model_copy(update={"suffix": False})
        rows.update({SOURCE_ROWS[source]: (decode if source == SUFFIX else alone, source) for source in sources})
    if decode.tree_rounds:
        rows[CHAIN] = (decode.chain_rounds(), DECODER if has_draft else LOOKUP)
        if has_draft and len(sources) > 1:
            rows[DRAFT_ONLY_CHAIN] = (decode.chain_rounds(), DRAFT)
    return rows


def challenger_rows(rows: dict[str, tuple[DecodeConfig, str]]) -> dict[str, tuple[DecodeConfig, str]]:
    """The rows of `decoder_rows` that a second draft runs too (`CHALLENGER_ROWS`): the decoder with it in place of
    the draft, and it alone as the draft runs alone; the same decode settings, so two drafts (say the champion and a
    feature draft) are compared in one interleaved run."""
    return {CHALLENGER_ROWS[name]: row for name, row in rows.items() if name in CHALLENGER_ROWS}


def draft_alpha_row(rows: dict[str, tuple[DecodeConfig, str]]) -> str | None:
    """The row of `decoder_rows` that measures the draft model's own acceptance α: the draft alone in chain rounds,
    as eval and the monitor measure it (a tree's α̂ counts its top-k too). None without a draft."""
    for name, (row_decode, kind) in rows.items():
        alone = kind == DRAFT or (kind == DECODER and row_decode.lookup_min_ngram is None)
        if alone and not row_decode.tree_rounds:
            return name
    return None


def describe_trees(decode: DecodeConfig, target, draft) -> str:
    """The tree rounds of `decode`'s decoder in words: its node budget schedule (and where an "auto" one came
    from, and whether the draft model was kept in its trees), its fixed budget, or chain rounds."""
    choice = tree_drafters(decode, target, draft, compiled=compiled_lean(target.model) is not None)
    if choice is not None:
        drafters = f"; {choice.reason}" if choice.reason else ""
        return f"tree budget by context {[list(e) for e in choice.budget.schedule]} ({choice.budget.source}){drafters}"
    return f"tree budget {decode.tree_budget}" if decode.tree_budget else "chain rounds"
