"""Step costs measured through the decoder's own functions: the one step-cost timer of bench (`step_costs`: one
decoder's c and v), the sweep (`measure_costs`, `measure_batch_costs`) and the auto tree budget; the timing primitives
are `decode.runtime.timing`'s, and the prediction from these costs is `decode.measure.sweep_prediction`'s.

Measured with the KV cache filled to each context length L: the target's prefill, greedy step t(L) and verify round
of n = 2..γmax+1 tokens (v(n) = verify / t); per draft its prefill and one round of γ proposals for every γ
(c(γ) = round / (γ t); prompt lookup's round is one lookup); for token trees, the verify round of the pending token and
B nodes for every node budget B (v_tree(B) = tree verify / t; `decode.tree_budget_prediction` turns them into a
budget by
context length).

The batch axis (`measure_batch_costs`, `predict_batches`): B sequences at one context length, through the lean forward
of a batch, as a serving engine decodes them: the target's step of B × 1 tokens, its verify of B × n, each draft
model's step of B × 1. As B grows the target turns from memory-bound to compute-bound, verifying n tokens costs more
than one step, and the gain shrinks; the batch where the best γ stops paying is reported per draft.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch

from decode.drafters.chain import output_size
from decode.drafters.lookup import LookupThenModelDrafter, PromptLookupDrafter
from decode.drafters.tree_drafter import ModelTree, TreeDrafter
from decode.models.feature_draft import FeatureDraft, FeatureDrafter
from decode.runtime.forward import ModelRunner, rollback
from decode.runtime.lean import LeanDecoder, lean_problem, require_lean
from decode.runtime.timing import timed
from decode.speculative import Warp, check_drafts
from decode.token_tree import TokenTree, accept

# --------------------------------------------------------------------------- measured costs


def time_rounds(timers: Mapping[tuple[str, int], tuple[Callable, Callable]], device: torch.device,
                reps: int) -> dict[tuple[str, int], list[float]]:
    """Seconds of each timer's run over `reps` repetitions after 2 warm-up ones, every timer once a repetition (so
    that a burst of load hits them alike), its undo (a cache rollback) after each run."""
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in timers}
    for rep in range(reps + 2):
        for key, (run, undo) in timers.items():
            seconds = timed(run, device)[1]
            undo()
            if rep >= 2:  # warm-up
                samples[key].append(seconds)
    return samples


class FeatureRounds:
    """A drafter that reads the target's features (`decode.models.feature_draft.FeatureDrafter`), as `measure_costs`
    times it: the target's features of the timed tokens computed once up front (one pass), `start` feeds the prefix's,
    and every round starts with one pending feature, what the decoder hands over after a round that accepted nothing."""

    def __init__(self, drafter, target_model, tokens: list[int]):
        self.drafter = drafter
        device = next(target_model.parameters()).device
        runner = ModelRunner(target_model)
        _, self.features = runner.forward_features(torch.tensor(tokens, device=device), runner.new_cache(), 0,
                                                   drafter.feature_layers)

    def start(self, seq: list[int]):
        state = self.drafter.start(seq)
        self.drafter.observe(state, self.features[: len(seq) - 2])
        self.drafter.feed_pending(state, seq[:-1])
        self.drafter.observe(state, self.features[len(seq) - 2 : len(seq) - 1])
        return state

    def propose(self, state, seq: list[int], k: int, warp: Warp, generator):
        return self.drafter.propose(state, seq, k, warp, generator)

    def rollback(self, state, length: int) -> None:
        self.drafter.rollback(state, length)
        self.drafter.observe(state, self.features[state.verified : length])


@torch.inference_mode()
def measure_costs(target_model, proposers: Mapping[str, object], tokens: list[int], contexts: Sequence[int],
                  gammas: Sequence[int], reps: int = 10, prefill_reps: int = 3,
                  tree_budgets: Sequence[int] = ()) -> dict:
    """Median seconds at each context length L, through the decoder's own functions (greedy warp).

    proposers: draft name -> what the decoder drafts with (a `ModelDrafter`, a feature drafter, timed as
    `FeatureRounds`, or a model-free drafter).
    Target: prefill of L tokens, one greedy step, and a verify round of n = 2..γmax+1 tokens (forward with every
    logit, the decoder's acceptance test `check_drafts`, the one sync). Per draft: its prefill (`start`) and one
    round of γ proposals (`propose`: forwards, warps and sampling of a draft model, or one lookup) for every γ.
    Per tree budget B: a tree round's verify on `TokenTree.breadth_first(B)` as the decoder runs it (`tree_round`: the
    attention mask, the target's tree forward of the pending token and B nodes, the greedy walk `accept`).
    Every repetition times every quantity once, so a burst of load on the shared machine hits them alike; c and v
    are medians of the per-repetition ratios to that repetition's target step.
    """
    proposers = {name: FeatureRounds(d, target_model, tokens) if getattr(d, "feature_layers", ()) else d
                 for name, d in proposers.items()}
    device = next(target_model.parameters()).device
    vocab_size = target_model.get_output_embeddings().weight.shape[0]
    warp, max_gamma = Warp(), max(gammas)
    runner = ModelRunner(target_model)  # the decoder's own target forward

    def prefill(start: Callable[[], object]) -> tuple[object, float]:
        runs = [timed(start, device) for _ in range(prefill_reps)]
        return runs[-1][0], statistics.median(seconds for _, seconds in runs)

    def target_prefill(length: int):
        cache = runner.new_cache()
        runner.forward(torch.tensor(tokens[:length], device=device), cache, 0, True)
        return cache

    def step(cache, length: int) -> Callable[[], int]:
        fed = torch.tensor(tokens[length : length + 1], device=device)
        return lambda: runner.forward(fed, cache, length, True)[-1].argmax().item()

    def verify_round(cache, length: int, n: int) -> Callable[[], list]:
        fed = torch.tensor(tokens[length : length + n], device=device)
        q = torch.nn.functional.one_hot(fed[1:], vocab_size).float()

        def run() -> list:
            accepted, next_tokens = check_drafts(runner.forward(fed, cache, length, False), q, fed[1:], warp, None)
            return torch.cat([accepted.long(), fed[1:], next_tokens]).tolist()

        return run

    def tree_verify(cache, length: int, budget: int) -> Callable[[], object]:
        tree = TokenTree.breadth_first(budget, vocab_size)
        fed, positions, mask = tree.pass_inputs(tokens[length], length, device)
        return lambda: accept(tree, runner.forward_tree(fed, cache, length, positions, mask), warp, None)

    # (quantity key, context index) -> (run, undo)
    timers: dict[tuple[str, int], tuple[Callable, Callable]] = {}
    prefill_s: dict[str, list[float]] = {"target": [], **{name: [] for name in proposers}}
    for i, length in enumerate(contexts):
        cache, seconds = prefill(lambda: target_prefill(length))
        prefill_s["target"].append(seconds)
        undo = (lambda c, n: lambda: rollback(c, n))(cache, length)
        timers[("step", i)] = (step(cache, length), undo)
        for n in range(2, max_gamma + 2):
            timers[(f"verify{n}", i)] = (verify_round(cache, length, n), undo)
        for budget in tree_budgets:
            timers[(f"tree{budget}", i)] = (tree_verify(cache, length, budget), undo)
        seq = tokens[: length + 1]
        for name, drafter in proposers.items():
            state, seconds = prefill(lambda: drafter.start(seq))
            prefill_s[name].append(seconds)
            for gamma in gammas:
                run = (lambda d, st, sq, g: lambda: d.propose(st, sq, g, warp, None))(drafter, state, seq, gamma)
                undo_draft = (lambda d, st, n: lambda: d.rollback(st, n))(drafter, state, length)
                timers[(f"{name}|{gamma}", i)] = (run, undo_draft)
    samples = time_rounds(timers, device, reps)
    return {"contexts": list(contexts), **cost_table(samples, prefill_s, list(proposers), gammas, tree_budgets)}


def cost_table(samples: dict, prefill_s: dict[str, list[float]], names: list[str], gammas: Sequence[int],
               tree_budgets: Sequence[int]) -> dict:
    """`measure_costs`' result from its timed samples (one prefill per context): medians per context, and c and v
    as medians of the per-repetition ratios to that repetition's target step."""
    max_gamma, n_contexts = max(gammas), len(prefill_s["target"])

    def seconds_of(key: str) -> list[float]:
        return [statistics.median(samples[(key, i)]) for i in range(n_contexts)]

    def ratio_to_step(key: str, divisor: int = 1) -> list[float]:
        return [statistics.median(s / (divisor * t) for s, t in zip(samples[(key, i)], samples[("step", i)]))
                for i in range(n_contexts)]

    verify_keys = [str(n) for n in range(2, max_gamma + 2)]
    target = {"prefill_s": prefill_s["target"], "step_s": seconds_of("step"),
              "verify_s": {n: seconds_of(f"verify{n}") for n in verify_keys},
              "v": {n: ratio_to_step(f"verify{n}") for n in verify_keys},
              "tree_verify_s": {str(b): seconds_of(f"tree{b}") for b in tree_budgets},
              "v_tree": {str(b): ratio_to_step(f"tree{b}") for b in tree_budgets}}
    per_draft = {name: {"prefill_s": prefill_s[name],
                        "round_s": {str(g): seconds_of(f"{name}|{g}") for g in gammas},
                        "c": {str(g): ratio_to_step(f"{name}|{g}", g) for g in gammas}} for name in names}
    return {"target": target, "drafts": per_draft}


@torch.inference_mode()
def measure_batch_costs(target_model, draft_models: Mapping[str, torch.nn.Module], tokens: list[int], context: int,
                        batches: Sequence[int], widths: Sequence[int], reps: int = 10) -> dict:
    """Median seconds of a batch of B sequences, each `context` tokens long (`tokens[:context]`), for every B in
    `batches`, through `decode.runtime.lean.LeanDecoder.forward_batch` (the decoder's own forward, batched): the
    target's step (B × 1 tokens, last logits, argmax), its verify of B × n tokens for every n in `widths` (every
    logit, argmax), and each draft model's step (B × 1). v_B(n) = verify / step and c_B = draft step / target step
    are medians of per-repetition ratios, every quantity timed once a repetition (`measure_costs`). Draft models the
    lean forward does not run (a feature draft) are left out and named under "skipped"."""
    require_lean(target_model, "the batch axis")
    device = next(target_model.parameters()).device
    models = {"target": target_model}
    skipped = []
    for name, model in draft_models.items():
        if lean_problem(model) is None:
            models[name] = model
        else:
            skipped.append(name)
    prefix = torch.tensor(tokens[:context], device=device)
    fed = torch.tensor(tokens[context : context + max(widths, default=1)], device=device)
    timers: dict[tuple[str, int], tuple[Callable, Callable]] = {}
    for name, model in models.items():
        lean = LeanDecoder(model)
        single = lean.new_cache()
        lean.forward_logits(prefix, single, 0, True)
        for b in batches:
            cache = single.repeated(b)
            undo = (lambda c: lambda: c.crop(context))(cache)

            def forward(n: int, lean=lean, cache=cache, b=b) -> list:
                return lean.forward_batch(fed[:n].repeat(b, 1), cache, context, n == 1).argmax(-1).tolist()

            timers[(name, b)] = (partial(forward, 1), undo)
            if name == "target":
                for n in widths:
                    timers[(f"verify{n}", b)] = (partial(forward, n), undo)
    samples = time_rounds(timers, device, reps)

    def seconds_of(key: str) -> list[float]:
        return [statistics.median(samples[(key, b)]) for b in batches]

    def ratio_to_step(key: str) -> list[float]:
        return [statistics.median(s / t for s, t in zip(samples[(key, b)], samples[("target", b)])) for b in batches]

    return {"context": context, "batches": list(batches), "skipped": skipped,
            "target": {"step_s": seconds_of("target"),
                       "verify_s": {str(n): seconds_of(f"verify{n}") for n in widths},
                       "v": {str(n): ratio_to_step(f"verify{n}") for n in widths}},
            "drafts": {name: {"step_s": seconds_of(name), "c": ratio_to_step(name)} for name in models
                       if name != "target"}}


# --------------------------------------------------------------------------- the cost model


# --------------------------------------------------------------------------- one decoder's step costs (bench)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def costed_drafter(drafter, vocab_size: int):
    """The chain drafter whose step `step_costs` charges for `drafter`: the model half of a lookup-first hybrid, the
    model source of a token tree (its first), prompt lookup for a tree without one, else the drafter itself. For
    trees `step_costs` also times the tree's own verify (`tree_budget`)."""
    if isinstance(drafter, LookupThenModelDrafter):
        return drafter.model
    if isinstance(drafter, TreeDrafter):
        models = [source.drafter for source in drafter.sources if isinstance(source, ModelTree)]
        return models[0] if models else PromptLookupDrafter(vocab_size)
    return drafter


@torch.inference_mode()
def step_costs(target: ModelRunner, draft, prompt: list[int], gamma: int, reps: int = 20,
               tree_budget: int = 0) -> dict[str, float]:
    """Median seconds of one cached target step, one draft step and one (γ+1)-token verify; c and v as ratios. With
    `tree_budget` nodes also a tree verify of that many (`decode.token_tree.TokenTree.breadth_first`) and v_tree.

    Timed the way the decoder runs them: target is its `ModelRunner`, draft its `ModelDrafter` or a
    `PromptLookupDrafter`, whose step is one lookup of γ tokens divided by γ (one lookup per round).
    """

    def cost(forward, cache, device, n_tokens: int) -> float:
        forward(torch.tensor(prompt, device=device), cache, 0, True)
        tokens = torch.tensor(prompt[-1:] * n_tokens, device=device)
        times = []
        for _ in range(reps + 2):
            _, seconds = timed(lambda: forward(tokens, cache, len(prompt), n_tokens == 1), device)
            rollback(cache, len(prompt))
            times.append(seconds)
        return statistics.median(times[2:])

    def target_cost(n_tokens: int) -> float:
        return cost(target.forward, target.new_cache(), _device(target.model), n_tokens)

    if isinstance(draft, PromptLookupDrafter):
        lookups = [timed(lambda: draft.lookup(prompt, gamma), torch.device("cpu"))[1] for _ in range(reps + 2)]
        draft_step = statistics.median(lookups[2:]) / gamma
    elif isinstance(draft, FeatureDrafter):  # one step of the feature draft and its head, on stand-in features
        draft_step = cost(feature_step(draft.model), draft.model.new_cache(), draft.device, 1)
    else:  # the ModelDrafter the decoder runs: the draft's forward as the decoder calls it
        draft_step = cost(draft.runner.forward, draft.runner.new_cache(), draft.device, 1)

    def tree_cost(budget: int) -> float:
        device = _device(target.model)
        tree = TokenTree.breadth_first(budget, output_size(target.model))
        tokens, positions, mask = tree.pass_inputs(prompt[-1], len(prompt), device)
        cache = target.new_cache()
        target.forward(torch.tensor(prompt, device=device), cache, 0, True)
        times = [timed(lambda: target.forward_tree(tokens, cache, len(prompt), positions, mask), device)[1]
                 for _ in range(reps + 2)]
        return statistics.median(times[2:])

    target_step, verify = target_cost(1), target_cost(gamma + 1)
    costs = {"target_step_s": target_step, "draft_step_s": draft_step, "verify_s": verify,
             "c": draft_step / target_step, "v": verify / target_step}
    if tree_budget:
        tree_verify = tree_cost(tree_budget)
        costs.update(tree_budget=tree_budget, tree_verify_s=tree_verify, v_tree=tree_verify / target_step)
    return costs


def feature_step(draft: FeatureDraft) -> Callable:
    """A feature draft's step in `step_costs`' forward signature: what a decoding step computes (the layer over the
    token and a hidden state, then the head), with zeros for the hidden state (the cost does not depend on it)."""
    def forward(tokens: torch.Tensor, cache, start: int, keep_last: bool) -> torch.Tensor:
        hidden = torch.zeros(tokens.shape[0], draft.config.hidden_size, dtype=draft.fc.weight.dtype,
                             device=tokens.device)
        positions = torch.arange(start + 1, start + 1 + tokens.shape[0], device=tokens.device)
        out = draft.step(hidden, tokens, cache, start, positions)
        return draft.logits(out[-1:] if keep_last else out)
    return forward
