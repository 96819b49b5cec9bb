"""`decode:`: how the speculative decoder is built (γ, drafters, token trees, compiled passes)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.context_schedule import ContextSchedule

# `draftops sweep` on a 2-core AMD EPYC (docs/concepts.md#token-trees): what `tree_budget_schedule: auto` falls back to
DEFAULT_TREE_BUDGET_SCHEDULE = [(320, 4), (1280, 8), (2048, 4)]
AUTO = "auto"


class DecodeConfig(Section):
    gamma: int = Field(5, ge=1, description="Draft tokens proposed per target call.")
    gamma_policy: Literal["fixed", "schedule", "adaptive"] = Field("fixed", description=(
        "fixed: gamma every round; schedule: γ by sequence length from gamma_schedule; adaptive: start at gamma, +2 "
        "after a block accepted whole, −1 otherwise."))
    gamma_schedule: list[tuple[int, int]] | None = Field(None, description=(
        "With gamma_policy schedule: [[max_context, gamma], ...] with increasing max_context, γ by current sequence "
        "length (prompt + generated; the last γ beyond). `draftops sweep` writes one."))
    lookup_min_ngram: int | None = Field(2, ge=1, description=(
        "The decoder proposes prompt-lookup continuations first wherever an n-gram of at least this many tokens "
        "repeats in the text so far, the draft model elsewhere. null: the draft model only."))
    draft_min_confidence: float | None = Field(0.4, gt=0.0, le=1.0, description=(
        "A draft model ends its block at the first token (after the first) whose top probability is below this, "
        "saving draft steps and verify width where it is likely wrong. null: always draft gamma tokens."))
    tree_budget: int = Field(0, ge=0, description=(
        "Tree rounds: up to this many candidates per target call (prompt lookup's matches, suffix decoding's with "
        "suffix, then the draft model's tree) merged into one token tree and verified in one pass, gamma levels deep "
        "at most (docs/concepts.md#token-trees). A budget > 0 replaces tree_budget_schedule. 0: tree_budget_schedule "
        "decides."))
    tree_budget_schedule: list[tuple[int, int]] | Literal["auto"] | None = Field(AUTO, description=(
        "Tree rounds with the node budget by sequence length: [[max_context, budget], ...] with increasing "
        "max_context (prompt + generated; the last budget beyond), instead of tree_budget (which stays 0). auto: the "
        "schedule `draftops sweep` would recommend, from this machine's tree verify costs (timed once per machine, "
        "target and draft, and cached) and the rank acceptance the draft's distill measured; trees without a draft "
        "model (prompt lookup, suffix decoding) from those costs and their rounds replayed on the suffix index's "
        "responses; without those (an older draft; no draft model and no suffix index) "
        f"{[list(e) for e in DEFAULT_TREE_BUDGET_SCHEDULE]}, one 2-core CPU's (docs/concepts.md#token-trees). "
        "null with "
        "tree_budget 0: chain rounds."))
    use_draft: Literal["auto", "always"] = Field(AUTO, description=(
        "Tree rounds with tree_budget_schedule auto: whether the decoder's trees (prompt lookup, suffix decoding and "
        "the draft model) use the draft model. auto: only where, on this machine's measured costs, the draft's tree "
        "is predicted faster than prompt lookup's and suffix decoding's alone (their rounds replayed on the suffix "
        "index; measured once and cached, and said on stderr); where that cannot be predicted, the draft stays. "
        "always: the draft is used (docs/concepts.md#token-trees)."))
    suffix: bool = Field(True, description=(
        "Tree rounds: suffix decoding's candidates join the tree after prompt lookup's, before the draft model's: "
        "continuations of the text's last tokens in the target's earlier outputs (the suffix index `make distill` "
        "ships beside the draft) and in the request itself (the request alone when the draft has no index). Tree "
        "rounds only: chain rounds take prompt lookup and the draft model (docs/concepts.md#token-trees)."))
    suffix_index: str | None = Field(None, description=(
        "With suffix: a suffix index file (`draftops suffix-index` builds one from the target's responses to a "
        "traffic file) instead of the one beside the draft. null: the draft's own."))
    compiled: bool = Field(False, description=(
        "Run the target's and the draft model's passes after the prompt (steps, verify blocks and trees of up to 16 "
        "tokens) through torch.compile: on a CPU, inductor's C++ GEMMs on weights packed once and each pass one call. "
        "Faster steps, after minutes of compiling per model in every process (docs/concepts.md#the-cpu-runtime); "
        "prefills and wider passes stay eager."))
    tree_branching: int = Field(4, ge=1, description=(
        "Tree rounds: nodes per level of the draft model's tree (each level keeps the best children of the last by "
        "cumulative draft probability) and prompt lookup's branches."))
    tree_rerank: bool = Field(True, description=(
        "Greedy tree rounds the draft model has to itself (no lookup or suffix candidates that round): its tree is "
        "the budget's best of every candidate its beam found on any level (EAGLE-2's rerank: deep where the draft is "
        "sure, wide where it is not), a level expanded only from nodes that could still enter and whose cumulative "
        "probability reaches draft_min_confidence. false: each level's best children in turn, as sampled rounds and "
        "rounds behind other sources grow it (docs/concepts.md#token-trees)."))
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)

    @property
    def tree_rounds(self) -> bool:
        """Tree rounds (a node budget or a budget schedule) rather than chains."""
        return bool(self.tree_budget) or self.tree_budget_schedule is not None

    @property
    def suffix_decoding(self) -> bool:
        """Suffix decoding joins the trees (`suffix` is read in tree rounds only)."""
        return self.suffix and self.tree_rounds

    def chain_rounds(self) -> DecodeConfig:
        """These settings as a chain decoder (suffix decoding is a tree source only): what eval and the monitor
        measure the draft's own acceptance α with, and bench's chain rows."""
        return self.model_copy(update={"tree_budget": 0, "tree_budget_schedule": None, "suffix": False,
                                       "suffix_index": None})

    @model_validator(mode="before")
    @classmethod
    def _fixed_budget_replaces_schedule(cls, data):
        if isinstance(data, dict) and data.get("tree_budget"):
            data = {**data, "tree_budget_schedule": None}
        return data

    @field_validator("gamma_schedule", "tree_budget_schedule")
    @classmethod
    def _a_context_schedule(cls, value, info):
        """A schedule by context is checked when the config loads, not at the first decode."""
        if value is None or value == AUTO:
            return value
        return [tuple(entry) for entry in ContextSchedule.parse(value, f"decode.{info.field_name}").entries]

    @model_validator(mode="after")
    def _schedule_matches_policy(self) -> DecodeConfig:
        if (self.gamma_policy == "schedule") != (self.gamma_schedule is not None):
            raise ValueError("decode.gamma_schedule is set exactly when decode.gamma_policy is 'schedule'")
        if self.suffix_index is not None and not (self.suffix and self.tree_rounds):
            raise ValueError("decode.suffix_index is read by suffix decoding in tree rounds: set decode.suffix=true "
                             "and a tree budget (or schedule) with it")
        return self


