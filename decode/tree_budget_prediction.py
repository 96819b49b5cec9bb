"""How many nodes a token tree should have at each context length: predicted tokens/s per node budget from the
sweep's measured costs and a Sequoia-style acceptance model (Chen et al. 2024).

It holds the model alone (rank acceptance, the best trees, the predicted rows and the recommended schedule), apart
from what measures its inputs: `draftops sweep` prices trees with it, and `decode.tree_budget_measured` makes the
same recommendation where the decoder runs. The model, its dynamic program and why its τ is an upper bound for the
decoder's beam: docs/concepts.md#the-node-budget.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.acceptance import expected_tokens
from decode.token_tree import ROOT
from pipeline.files import write_text_atomic
from pipeline.sources import TREE_ACCEPTANCE_FILE

TREE_BUDGETS = (2, 3, 4, 8, 16, 32, 64)  # the node budgets whose tree verify is timed (`draftops sweep`, auto)


def rank_acceptance(ranks: Sequence[Sequence[int]], max_rank: int) -> list[float]:
    """p_r for r = 1..max_rank: the share of all positions whose rank (`AnalyticAcceptance.ranks`) is r.

    p_r is then taken as the same at every depth and independent of what was accepted above (Sequoia's positional
    acceptance): the draft at an accepted node has seen exactly the target's prefix, which the teacher-forced pass
    reproduces, but runs of right and wrong guesses are correlated in real text, and the model ignores that."""
    counts = Counter(r for sequence in ranks for r in sequence)
    total = sum(counts.values())
    if not total:
        raise ValueError("no ranked positions")
    return [counts[r] / total for r in range(1, max_rank + 1)]


def save_rank_acceptance(draft_dir: str | Path, p: Sequence[float], positions: int) -> None:
    """Write p_1.. (`rank_acceptance`) over `positions` held-out positions to the draft folder's
    `TREE_ACCEPTANCE_FILE`, where `decode.tree_budget_measured` reads it."""
    write_text_atomic(Path(draft_dir) / TREE_ACCEPTANCE_FILE,
                      json.dumps({"rank_acceptance": [float(x) for x in p], "positions": int(positions)}, indent=1))


def load_rank_acceptance(draft_dir: str | Path) -> list[float] | None:
    """p_1.. as `save_rank_acceptance` wrote them; None when the folder has none (a draft distilled before they were
    stored, or not by draftops) or the file is not a valid one."""
    try:
        p = json.loads((Path(draft_dir) / TREE_ACCEPTANCE_FILE).read_text())["rank_acceptance"]
        p = [float(x) for x in p]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return p if p and min(p) >= 0 and sum(p) <= 1 + 1e-9 else None


@dataclass
class BestTrees:
    """The best trees for p up to `max_nodes` nodes and `max_depth` levels (`best_trees`)."""

    p: list[float]
    max_nodes: int
    max_depth: int
    below: list[np.ndarray]  # below[d][m]: S_d(m), expected accepted nodes of the best m nodes at most d levels deep
    sizes: list[np.ndarray]  # sizes[d][i, m]: subtree size of the rank-(i+1) child when ranks i+1.. share m nodes

    def tau(self, nodes: int, depth: int) -> float:
        """Expected new tokens per round of the best tree of `nodes` nodes and at most `depth` levels."""
        return 1.0 + float(self.below[depth][nodes])

    def parents(self, nodes: int, depth: int) -> list[int]:
        """That tree's parents (`decode.token_tree.ROOT` for the first level), parents before children, siblings in rank
        order; nodes that add nothing are left out (the fewest nodes with the same τ, e.g. ranks the draft never gets
        right)."""
        below = self.below[depth]
        nodes = int(np.argmax(below[: nodes + 1] >= below[nodes] - 1e-12))
        out: list[int] = []

        def grow(parent: int, m: int, d: int) -> None:
            rank = 0
            while m > 0:
                size = int(self.sizes[d][rank, m])
                out.append(parent)
                grow(len(out) - 1, size - 1, d - 1)
                m -= size
                rank += 1

        grow(ROOT, nodes, depth)
        return out


def best_trees(p: Sequence[float], max_nodes: int, max_depth: int) -> BestTrees:
    """Sequoia's dynamic program over rank acceptances p (p[0] for rank 1; missing ranks count as 0), for every node
    count up to max_nodes and depth bound up to max_depth. A node's children are the draft's ranks 1..k, none skipped
    (the draft's tree offers its top choices):
    S_d(m) = max over k and s_1..s_k ≥ 1 with Σ s_i = m of Σ_i p_i · (1 + S_{d−1}(s_i − 1)), S_0(0) = 0."""
    if max_nodes < 1 or max_depth < 1:
        raise ValueError(f"need max_nodes and max_depth >= 1, got {max_nodes} and {max_depth}")
    n = max_nodes
    ranks = np.zeros(n)  # rank n+1 can never be used by n nodes
    given = np.asarray(list(p)[:n], dtype=float)
    ranks[: len(given)] = given
    if (ranks < 0).any() or ranks.sum() > 1 + 1e-9:
        raise ValueError(f"rank acceptances must be >= 0 and sum to at most 1, got {list(p)}")
    below = [np.full(n + 1, -np.inf)]
    below[0][0] = 0.0
    sizes = [np.zeros((n, n + 1), dtype=int)]
    for d in range(1, max_depth + 1):
        child = 1.0 + below[d - 1][:-1]  # child[s - 1]: accepted nodes of a subtree of s nodes, its root accepted
        feasible, child = np.isfinite(child), np.where(np.isfinite(child), child, 0.0)
        rest = np.full((n + 1, n + 1), -np.inf)  # rest[i, m]: ranks i+1.. sharing m nodes (i = n: none left)
        rest[:, 0] = 0.0
        size = np.zeros((n, n + 1), dtype=int)
        for i in range(n - 1, -1, -1):
            value = np.where(feasible, ranks[i] * child, -np.inf)
            for m in range(1, n + 1):
                options = value[:m] + rest[i + 1, m - 1 :: -1]  # subtree sizes 1..m, the rest to later ranks
                best = int(np.argmax(options))
                rest[i, m], size[i, m] = options[best], best + 1
        below.append(rest[0])
        sizes.append(size)
    return BestTrees(list(ranks), n, max_depth, below, sizes)


def tree_shape(parents: Sequence[int]) -> tuple[int, int]:
    """(depth, widest level) of a tree given by its parents, parents first."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    widths = Counter(depths)
    return max(depths, default=0), max(widths.values(), default=0)


def draft_cost(costs: dict, draft: str, context_index: int, depth: int) -> float:
    """d·c(d) target steps for d draft forwards; c between measured γ linear, flat beyond them."""
    per_gamma = costs["drafts"][draft]["c"]
    gammas = sorted(int(g) for g in per_gamma)
    return depth * float(np.interp(depth, gammas, [per_gamma[str(g)][context_index] for g in gammas]))


def predict_tree_budgets(costs: dict, draft: str, p: Sequence[float], budgets: Sequence[int],
                         max_depth: int) -> tuple[list[dict], list[dict]]:
    """(tree rows, chain rows) of one draft at every measured context.

    A round of d levels costs d·c(d) (one draft forward per level, a level's width taken as free for the draft) plus
    v_tree(n); the draft's prefill is left out, as in the γ schedule's steady state. The decoder's beam
    (`decode.drafters.tree_drafter.ModelTree`) is not this program's tree, so each row reports its tree's depth and
    widest level: the γ and `tree_branching` a beam needs to reach that shape.

    Tree row per (context, budget): with the best depth bound d ≤ max_depth (the smallest on a tie), τ, the tree's
    nodes that can be accepted (`BestTrees.parents`), its depth and widest level, the draft cost d·c(d) and v_tree in
    target steps, predicted speedup over the target alone and tokens/s. Chain row per context: the best γ ≤ max_depth
    under the same model (τ = 1 + Σ_k p_1^k, cost γ·c(γ) + v(γ+1)), for comparison.
    costs: `decode.step_costs.measure_costs` with these tree budgets; p: `rank_acceptance`.
    """
    trees = best_trees(p, max(budgets), max_depth)
    target, rows, chains = costs["target"], [], []
    chain_depth = min(max_depth, max(int(n) for n in target["v"]) - 1)
    for i, context in enumerate(costs["contexts"]):
        step = target["step_s"][i]
        for budget in budgets:
            v = target["v_tree"][str(budget)][i]
            speedup, depth = max(((trees.tau(budget, d) / (draft_cost(costs, draft, i, d) + v), d)
                                  for d in range(1, max_depth + 1)), key=lambda pair: pair[0])
            shape = trees.parents(budget, depth)
            shape_depth, width = tree_shape(shape)
            rows.append({"draft": draft, "context": context, "budget": budget, "tau": trees.tau(budget, depth),
                         "nodes": len(shape), "depth": shape_depth, "width": width,
                         "draft_cost": draft_cost(costs, draft, i, depth), "v_tree": v, "predicted_speedup": speedup,
                         "predicted_tokens_per_s": speedup / step})
        chain = [(expected_tokens(trees.p[0], g) / (draft_cost(costs, draft, i, g) + target["v"][str(g + 1)][i]), g)
                 for g in range(1, chain_depth + 1)]
        speedup, gamma = max(chain, key=lambda pair: pair[0])
        chains.append({"draft": draft, "context": context, "gamma": gamma, "tau": expected_tokens(trees.p[0], gamma),
                       "predicted_speedup": speedup, "predicted_tokens_per_s": speedup / step})
    return rows, chains


def predict_model_free_budgets(costs: dict, name: str, tau: Mapping[int, float]) -> list[dict]:
    """Tree rows, as `predict_tree_budgets` gives them, of trees grown without a draft model (prompt lookup's
    branches, suffix decoding's candidates) at every measured context: τ(B) replayed on text the target wrote
    (`decode.tree_budget_measured.replayed_tau`: their acceptance is not a draft's rank acceptance, so the dynamic
    program has nothing to work on), no draft cost (their search runs on the host between passes, left out as the
    draft's prefill is), predicted speedup τ(B) / v_tree(B). The tree's shape is the sources' own: not reported."""
    target, rows = costs["target"], []
    for i, context in enumerate(costs["contexts"]):
        for budget, value in sorted(tau.items()):
            v = target["v_tree"][str(budget)][i]
            rows.append({"draft": name, "context": context, "budget": budget, "tau": value, "nodes": budget,
                         "depth": None, "width": None, "draft_cost": 0.0, "v_tree": v,
                         "predicted_speedup": value / v, "predicted_tokens_per_s": value / v / target["step_s"][i]})
    return rows


def context_schedule(contexts: Sequence[int], pick: Callable[[int], int]) -> list[list[int]]:
    """[[max_context, value], ...]: pick(L) at each measured context L, each entry covering lengths up to the midpoint
    with the next measured context (the last: up to its own); equal neighbours merge."""
    schedule: list[list[int]] = []
    contexts = sorted(contexts)
    for i, context in enumerate(contexts):
        value = pick(context)
        bound = (context + contexts[i + 1]) // 2 if i + 1 < len(contexts) else context
        if schedule and schedule[-1][1] == value:
            schedule[-1][0] = bound
        else:
            schedule.append([bound, value])
    return schedule


def recommend_tree_budget(rows: list[dict], contexts: Sequence[int]) -> dict:
    """The draft whose best budget per context has the best mean predicted speedup, and its node budget by context
    length (`context_schedule`): the budget with the most predicted tokens/s at each measured context
    (`decode.tree_budget_prediction.predict_tree_budgets`)."""
    drafts = list(dict.fromkeys(r["draft"] for r in rows))

    def best(draft: str, context: int) -> dict:
        return max((r for r in rows if r["draft"] == draft and r["context"] == context),
                   key=lambda r: r["predicted_tokens_per_s"])

    mean = {d: float(np.mean([best(d, c)["predicted_speedup"] for c in contexts])) for d in drafts}
    draft = max(mean, key=mean.get)
    return {"tree_draft": draft, "tree_mean_predicted_speedup": mean,
            "tree_budget_schedule": context_schedule(contexts, lambda c: best(draft, c)["budget"]),
            "tree_shapes": [{key: best(draft, c)[key] for key in ("context", "budget", "nodes", "depth", "width")}
                            for c in sorted(contexts)]}
