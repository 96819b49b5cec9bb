"""What `decode.tree_budget_schedule: auto` rests on: the token tree's node budget by context length, chosen where the
decoder runs from this machine's own costs and the draft's own rank acceptance.

The best tree depends on the hardware's verify-cost curve (Sequoia, Chen et al. 2024), so one machine's schedule does
not carry to another: this module measures the costs `draftops sweep` prices trees with once per machine, target and
draft (`decode.runtime.machine_choice` caches them) and makes the sweep's own recommendation
(`decode.tree_budget_prediction`) at decode time. Trees without a draft model have no rank acceptance: their τ(B) is
replayed on the target's responses (`replayed_tau`). Where a half is missing, the built-in schedule
(`pipeline.config.DEFAULT_TREE_BUDGET_SCHEDULE`) stands and the reason goes with it (`default_choice`).
docs/concepts.md#the-node-budget.
"""
from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decode.drafters.chain import make_drafter
from decode.drafters.protocol import DECODER, DRAFT, LOOKUP
from decode.drafters.suffix import SuffixIndex
from decode.drafters.tree_drafter import make_tree_drafter
from decode.runtime.kernels import cpu_linear_of
from decode.runtime.lean import COMPILED_MAX_TOKENS
from decode.runtime.machine_choice import cache_file, measured_once
from decode.sampling import Warp
from decode.step_costs import measure_costs
from decode.token_tree import ROOT
from decode.tree_budget_prediction import (
    TREE_BUDGETS,
    load_rank_acceptance,
    predict_model_free_budgets,
    predict_tree_budgets,
    recommend_tree_budget,
)
from pipeline.config import DEFAULT_TREE_BUDGET_SCHEDULE

CONTEXTS = (128, 512, 2048)  # the sweep's context lengths for trees; schedule entries split at their midpoints
REPS = 10  # timed repetitions of every quantity (the sweep's)
SEED = 0  # of the token ids timed: a tree pass costs the same whatever the tokens
COSTS, REPLAYED = "tree_costs", "tree_replayed_tau"  # the measurements' names in `machine_choice`
REPLAY_SEQUENCES = 32  # responses of the suffix index replayed for a model-free tree's τ(B) (`replayed_tau`)
MIN_REPLAY_SEQUENCES = 8  # fewer in the index: too little text to tell budgets apart, the built-in schedule stands


def to_stderr(line: str) -> None:
    """Where the line announcing a measurement goes by default."""
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class BudgetChoice:
    """The schedule `auto` gives and where it comes from ("measured" or why the built-in one stands)."""

    schedule: list[tuple[int, int]]
    source: str


def default_choice(reason: str) -> BudgetChoice:
    return BudgetChoice([tuple(e) for e in DEFAULT_TREE_BUDGET_SCHEDULE], f"built-in schedule: {reason}")


@dataclass(frozen=True)
class TextTrees:
    """A tree drafter without a draft model as `auto` replays it: `make_tree_drafter`'s kind ("lookup", "suffix")
    and settings, and the suffix index whose responses are the replayed text (searched by suffix decoding when
    `suffix`)."""

    kind: str
    index: SuffixIndex | None
    suffix: bool = True
    lookup_min_ngram: int | None = None
    branching: int = 2

    def settings(self) -> dict:
        """What τ(B) depends on besides the depth and budgets: the sources, and the index's contents."""
        digest = None if self.index is None else hashlib.sha256(self.index.tokens.tobytes()).hexdigest()[:16]
        return {"kind": self.kind, "suffix": self.suffix, "lookup_min_ngram": self.lookup_min_ngram,
                "branching": self.branching, "index": digest}


@dataclass(frozen=True)
class DecoderChoice:
    """What `auto` gives a tree decoder: the tree drafter kind it builds (the draft model's kind, DECODER or DRAFT, or
    the model-free trees' LOOKUP or SUFFIX where the draft model is left out or absent), its budget schedule, each
    measured candidate's mean predicted speedup over the target alone, and why."""

    kind: str
    budget: BudgetChoice
    predicted: dict[str, float]
    reason: str


def choose_trees(target, draft, trees: TextTrees | None, max_depth: int, *, draft_kind: str = DECODER,
                 compiled: bool = False, reps: int = REPS, log: Callable[[str], None] | None = None) -> DecoderChoice:
    """The trees of at most `max_depth` levels a decoder grows on this machine, and their node budget by context.

    Candidates: the draft model's tree (`draft`, its rank acceptance over this machine's draft and verify costs,
    `predict_tree_budgets`) and the trees grown without it (`trees`: τ(B) replayed over the same verify costs, no
    draft cost, `predict_model_free_budgets`); either may be None. The better mean predicted speedup over the
    measured contexts wins (`recommend_tree_budget`), so a draft model that costs more than it brings is left out. A
    candidate that cannot be predicted (no rank acceptance, too small a suffix index) is left out of the comparison;
    with none left the built-in schedule stands, with the reason. The costs are timed once (`tree_costs`: the
    target's, and the draft's where it is a candidate), τ(B) replayed once (`cached_replayed_tau`).

    target, draft: `pipeline.sources.ResolvedModel`s. compiled: whether the target's passes are compiled
    (`decode.runtime.lean.use_compiled_passes`): the costs are then those passes'. log: where the line announcing a
    measurement goes (stderr by default)."""
    p = load_rank_acceptance(draft.path) if draft is not None and draft.path is not None else None
    sequences = 0 if trees is None or trees.index is None else len(trees.index)
    replayable = sequences >= MIN_REPLAY_SEQUENCES
    if p is None and (draft is not None or not replayable):  # a draft is never left out unpredicted
        kind = trees.kind if draft is None and trees is not None else draft_kind
        return DecoderChoice(kind, default_choice(unpredictable(draft, sequences)), {},
                             drafter_reason(draft, trees, p, replayable))
    costs = tree_costs(target, draft if p is not None else None, max_depth, compiled=compiled, reps=reps, log=log)
    tau = cached_replayed_tau(trees, max_depth, log=log) if replayable else None
    rows = [] if p is None else predict_tree_budgets(costs, DRAFT, p, TREE_BUDGETS, max_depth)[0]
    rows += [] if tau is None else predict_model_free_budgets(costs, trees.kind, tau)
    pick = recommend_tree_budget(rows, costs["contexts"])
    predicted = pick["tree_mean_predicted_speedup"]
    source = "measured on this machine" if p is not None else (
        f"measured on this machine, τ replayed on {min(REPLAY_SEQUENCES, sequences // 2)} responses")
    budget = BudgetChoice([(int(m), int(b)) for m, b in pick["tree_budget_schedule"]], source)
    kept = pick["tree_draft"] == DRAFT
    reason = drafter_reason(draft, trees, p, replayable)
    if draft is not None and tau is not None:  # both candidates measured: the figures say why
        alone = "prompt lookup and suffix decoding" if trees.kind == LOOKUP else "suffix decoding"
        reason = (f"draft {'kept' if kept else 'left out'}: predicted {predicted[DRAFT]:.2f}x with the draft model, "
                  f"{predicted[trees.kind]:.2f}x with {alone} alone")
    return DecoderChoice(draft_kind if kept else trees.kind, budget, predicted, reason)


def unpredictable(draft, sequences: int) -> str:
    """Why no candidate of `choose_trees` can be predicted, as the built-in schedule's reason."""
    if draft is not None:
        return f"{draft.source} carries no rank acceptance (distilled before draftops stored it)"
    return (f"no draft model, and {'no' if not sequences else 'too small a'} suffix index to replay prompt lookup's "
            "and suffix decoding's trees on")


def drafter_reason(draft, trees: TextTrees | None, p, replayable: bool) -> str:
    """Why the draft model is in the trees without a comparison ("" where it was never weighed against trees without
    it)."""
    if draft is None or trees is None:
        return ""
    missing = "the draft carries no rank acceptance" if p is None else "too small a suffix index to replay"
    return f"draft kept: {missing}"


def replay_split(index: SuffixIndex, count: int = REPLAY_SEQUENCES) -> tuple[list[list[int]], SuffixIndex]:
    """(texts, index): `count` of the index's sequences (at most half of them) spread evenly through it, and an index
    of the others, so a replayed text never finds itself."""
    sequences = index.sequences()
    count = min(count, len(sequences) // 2)
    held = {int(i * len(sequences) / count) for i in range(count)}
    return ([s for i, s in enumerate(sequences) if i in held],
            SuffixIndex([s for i, s in enumerate(sequences) if i not in held]))


def replayed_tau(trees: TextTrees, budgets: Sequence[int], max_depth: int,
                 count: int = REPLAY_SEQUENCES) -> dict[int, float]:
    """τ(B), new tokens per round, of `trees` at each node budget B: greedy tree rounds of at most `max_depth` levels
    replayed on texts the target wrote (`replay_split`; the first token is the prompt), a node accepted where the
    path to it continues the text: what the decoder's greedy walk does where the target writes that text. The texts
    are responses without their prompts, so prompt lookup finds less to copy than in a request, most at the budgets
    it would fill."""
    texts, index = replay_split(trees.index, count)
    tau = {}
    for budget in budgets:
        drafter = make_tree_drafter(trees.kind, None, budget=budget, branching=trees.branching,
                                    lookup_min_ngram=trees.lookup_min_ngram, suffix=trees.suffix, suffix_index=index)
        tokens = rounds = 0
        for text in (t for t in texts if len(t) > 1):
            seq = text[:1]
            states = drafter.start(seq)
            while len(seq) < len(text):
                rest = text[len(seq):]
                tree, _ = drafter.grow(states, seq, min(max_depth, len(rest) - 1), Warp(), None)
                node, accepted = ROOT, 0
                while accepted < len(rest) - 1 and (node := tree.child(node, rest[accepted])) is not None:
                    accepted += 1
                seq = seq + rest[:accepted + 1]
                drafter.commit(states, seq)
                tokens, rounds = tokens + accepted + 1, rounds + 1
        tau[budget] = tokens / rounds
    return tau


def cached_replayed_tau(trees: TextTrees, max_depth: int,
                        log: Callable[[str], None] | None = None) -> dict[int, float]:
    """`replayed_tau` at `TREE_BUDGETS`, replayed once and cached (`machine_choice.measured` with no timing: it
    depends on the sources and the index, not on the machine)."""
    key = {"replayed_tau": trees.settings(), "max_depth": max_depth, "budgets": list(TREE_BUDGETS),
           "sequences": REPLAY_SEQUENCES}

    def replay() -> dict[str, float]:
        (log or to_stderr)(
            f"tree budget auto: replaying {trees.kind}'s trees of {min(TREE_BUDGETS)}-{max(TREE_BUDGETS)} nodes on "
            f"{min(REPLAY_SEQUENCES, len(trees.index) // 2)} of the suffix index's responses, once (cached under "
            f"{cache_file(REPLAYED, key, timed=False).parent})")
        return {str(b): t for b, t in replayed_tau(trees, TREE_BUDGETS, max_depth).items()}

    tau = measured_once(REPLAYED, key, replay, timed=False)
    return {int(b): float(t) for b, t in tau.items()}


def cost_contexts(model, max_depth: int) -> list[int]:
    """`CONTEXTS` the model's window holds with a verify of max_depth + 1 tokens and the deepest timed tree past
    them; a window too short for any: its quarter."""
    window = getattr(model.config, "max_position_embeddings", None)
    if window is None:
        return list(CONTEXTS)
    fits = [c for c in CONTEXTS if c + max(max_depth + 1, max(TREE_BUDGETS).bit_length()) < window]
    return fits or [max(2, window // 4)]


def cost_key(target, draft, max_depth: int, compiled: bool) -> dict:
    """What the measured costs hold for besides the machine (CPU, torch, threads: `machine_choice`): the GPU's name
    on one, the target and draft weights (draft None: the target's costs alone), their device, dtype, CPU kernels and
    compiled passes (`decode.compiled`: up to how many tokens a pass is compiled), and what was timed."""
    contexts = cost_contexts(target.model, max_depth)
    parameter = next(target.model.parameters())
    device = parameter.device
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "dtype": str(parameter.dtype), "kernels": cpu_linear_of(target.model),
            **({"compiled": COMPILED_MAX_TOKENS} if compiled else {}),
            "target": target.fingerprint, "draft": None if draft is None else draft.fingerprint,
            "contexts": contexts, "budgets": list(TREE_BUDGETS), "gammas": sorted({1, max_depth})}


def tree_costs(target, draft, max_depth: int, *, compiled: bool = False, reps: int = REPS,
               log: Callable[[str], None] | None = None) -> dict:
    """`measure_costs` of the target's tree verifies and the draft's rounds (γ 1 and max_depth, between which a
    tree level's cost is interpolated; none with draft None), timed once per machine and `cost_key`."""
    key = cost_key(target, draft, max_depth, compiled)
    contexts = key["contexts"]

    def measure() -> dict:
        timed = "" if draft is None else " and the draft's rounds"
        (log or to_stderr)(
            f"tree budget auto: timing the target's tree verify of {min(TREE_BUDGETS)}-{max(TREE_BUDGETS)} nodes"
            f"{timed} at contexts {contexts}, once on this machine (cached under {cache_file(COSTS, key).parent})")
        vocab_size = target.model.get_output_embeddings().weight.shape[0]
        tokens = torch.randint(vocab_size, (max(contexts) + max_depth + 2,),
                               generator=torch.Generator().manual_seed(SEED)).tolist()
        drafters = {} if draft is None else {
            DRAFT: make_drafter(DRAFT, target.model, draft.model, draft_token_ids=draft.token_ids)}
        return measure_costs(target.model, drafters, tokens, contexts, key["gammas"], reps=reps,
                             tree_budgets=TREE_BUDGETS)

    return measured_once(COSTS, key, measure)
