"""What `decode.tree_budget_schedule: auto` rests on: the token tree's node budget by context length, chosen where the
decoder runs from this machine's own costs and the draft's own rank acceptance.

The best tree depends on the hardware's verify-cost curve (Sequoia, Chen et al. 2024): where a pass over 8 nodes
costs about one target step, wide trees pay; where it costs two (a CPU without spare compute per weight read), two
nodes a round beat eight. So one machine's schedule does not carry to another, and `auto` measures instead: the costs
`draftops sweep` prices trees with (`decode.sweep_costs.measure_costs`: the target's step and its tree verify of
`TREE_BUDGETS` nodes, the draft's rounds, a feature draft's fed the target's features, at `CONTEXTS`), once per
machine, target and draft, cached as JSON under `$DRAFTOPS_HOME/tree_costs/` (not cached when the machine is busy,
as for `cpu_linear: auto`); the rank acceptances p_r are the draft's, measured by its distill on held-out responses
(`decode.tree_budget.load_rank_acceptance`; a feature draft's at its first position). The schedule is then the
sweep's own recommendation (`predict_tree_budgets`, `recommend_tree_budget`).

Where either half is missing the built-in schedule (`pipeline.config.DEFAULT_TREE_BUDGET_SCHEDULE`) stands and the
reason goes with it: no draft model (prompt lookup's and suffix decoding's trees alone), or a draft distilled before
p_r were stored.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.drafters import DRAFT, make_drafter
from decode.kernel_choice import machine_busy, machine_key
from decode.kernels import cpu_linear_of
from decode.sweep_costs import measure_costs
from decode.tree_budget import TREE_BUDGETS, load_rank_acceptance, predict_tree_budgets, recommend_tree_budget
from pipeline import draftops_home
from pipeline.config import DEFAULT_TREE_BUDGET_SCHEDULE
from pipeline.files import write_text_atomic

CONTEXTS = (128, 512, 2048)  # the sweep's context lengths for trees; schedule entries split at their midpoints
REPS = 10  # timed repetitions of every quantity (the sweep's)
SEED = 0  # of the token ids timed: a tree pass costs the same whatever the tokens
BUSY_TIMINGS: dict[Path, dict] = {}  # cache file -> costs timed on a busy machine, for this process only


@dataclass(frozen=True)
class BudgetChoice:
    """The schedule `auto` gives and where it comes from ("measured" or why the built-in one stands)."""

    schedule: list[tuple[int, int]]
    source: str


def default_choice(reason: str) -> BudgetChoice:
    return BudgetChoice([tuple(e) for e in DEFAULT_TREE_BUDGET_SCHEDULE], f"built-in schedule: {reason}")


def auto_budget_schedule(target, draft, max_depth: int, *, reps: int = REPS,
                         log: Callable[[str], None] | None = None) -> BudgetChoice:
    """The node budget by context length for trees of at most `max_depth` levels grown by `draft`.

    target, draft: `pipeline.sources.ResolvedModel`s (draft None: trees of prompt lookup and suffix decoding alone).
    log: where the one line announcing a measurement goes (stderr by default)."""
    if draft is None:
        return default_choice("no draft model")
    p = load_rank_acceptance(draft.path) if draft.path is not None else None
    if p is None:
        return default_choice(f"{draft.source} carries no rank acceptance (distilled before draftops stored it)")
    costs = tree_costs(target, draft, max_depth, reps=reps, log=log)
    rows, _ = predict_tree_budgets(costs, DRAFT, p, TREE_BUDGETS, max_depth)
    schedule = recommend_tree_budget(rows, costs["contexts"])["tree_budget_schedule"]
    return BudgetChoice([(int(m), int(b)) for m, b in schedule], "measured on this machine")


def cost_contexts(model, max_depth: int) -> list[int]:
    """`CONTEXTS` the model's window holds with a verify of max_depth + 1 tokens and the deepest timed tree past
    them; a window too short for any: its quarter."""
    window = getattr(model.config, "max_position_embeddings", None)
    if window is None:
        return list(CONTEXTS)
    fits = [c for c in CONTEXTS if c + max(max_depth + 1, max(TREE_BUDGETS).bit_length()) < window]
    return fits or [max(2, window // 4)]


def cost_key(target, draft, max_depth: int) -> dict:
    """What the measured costs hold for: this machine (CPU, torch, threads; the GPU's name on one), the target and
    draft weights, their device, dtype and CPU kernels, and what was timed."""
    parameter = next(target.model.parameters())
    device = parameter.device
    return {"machine": machine_key(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "dtype": str(parameter.dtype), "kernels": cpu_linear_of(target.model),
            "target": target.fingerprint, "draft": draft.fingerprint,
            "contexts": cost_contexts(target.model, max_depth), "budgets": list(TREE_BUDGETS),
            "gammas": sorted({1, max_depth})}


def cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return draftops_home() / "tree_costs" / f"{digest}.json"


def read_costs(path: Path, key: dict) -> dict | None:
    """The costs cached in `path` for `key`; None if missing, unreadable or for another key."""
    try:
        data = json.loads(path.read_text())
        return data["costs"] if data["key"] == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tree_costs(target, draft, max_depth: int, *, reps: int = REPS, log: Callable[[str], None] | None = None) -> dict:
    """`measure_costs` of the target's tree verifies and the draft's rounds (γ 1 and max_depth, between which a
    tree level's cost is interpolated), from the cache or measured and cached; timings a busy machine gave are kept
    for the rest of this process only (`BUSY_TIMINGS`), so its later decoders do not time again."""
    key = cost_key(target, draft, max_depth)
    path = cache_file(key)
    cached = BUSY_TIMINGS.get(path) or read_costs(path, key)
    if cached is not None:
        return cached
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    contexts = key["contexts"]
    log(f"tree budget auto: timing the target's tree verify of {min(TREE_BUDGETS)}-{max(TREE_BUDGETS)} nodes and "
        f"the draft's rounds at contexts {contexts}, once on this machine (cached under {path.parent})")
    vocab_size = target.model.get_output_embeddings().weight.shape[0]
    tokens = torch.randint(vocab_size, (max(contexts) + max_depth + 2,),
                           generator=torch.Generator().manual_seed(SEED)).tolist()
    drafter = make_drafter(DRAFT, target.model, draft.model, draft_token_ids=draft.token_ids)
    costs = measure_costs(target.model, {DRAFT: drafter}, tokens, contexts, key["gammas"], reps=reps,
                          tree_budgets=TREE_BUDGETS)
    busy = machine_busy()
    if busy:
        log(f"tree budget auto: timed on a busy machine ({busy}): used by this process, not cached")
        BUSY_TIMINGS[path] = costs
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"key": key, "costs": costs}, indent=1))
    return costs
