"""Token trees: many candidate continuations verified in one target pass, and their lossless acceptance.

`TokenTree` holds the candidates a round's sources propose (`decode.drafters.tree_drafter`), its mask and pass inputs;
`accept` walks the verified tree. It is apart from the sources so that the one test every tree round goes through is
written once, whoever proposed the nodes. The tree, its acceptance and the rules a source must keep for the sampled
test to stay lossless: docs/concepts.md#token-trees; `tests/lossless/test_token_trees.py` holds the chi-square
tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decode.sampling import Warp, sample

ROOT = -1  # the parent of first-level nodes: the pending token


@dataclass(frozen=True)
class Trial:
    """One proposal of `node` under its parent: q is the distribution its token was drawn from (target vocabulary),
    None for a deterministic candidate."""

    node: int
    q: torch.Tensor | None


class TokenTree:
    """Candidate continuations of a sequence, parents before children (node order is the target's feed order). The
    same token under the same parent is one node, whoever proposed it, so identical prefixes are verified once; a
    parent's trials keep the order in which they were drawn, which the sampled test depends on."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.sources: list[str] = []
        self._children: dict[int, dict[int, int]] = {ROOT: {}}  # parent -> token -> node
        self._trials: dict[int, list[Trial]] = {ROOT: []}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def child(self, parent: int, token: int) -> int | None:
        return self._children[parent].get(token)

    def children(self, parent: int) -> list[int]:
        return list(self._children[parent].values())

    def trials(self, parent: int) -> list[Trial]:
        return self._trials[parent]

    @classmethod
    def breadth_first(cls, budget: int, vocab_size: int, source: str = "timing") -> TokenTree:
        """A tree of `budget` nodes, breadth-first, two children per node (siblings hold different tokens, so none
        merge): what the step-cost timer verifies (`decode.step_costs`). A tree pass costs the same for any shape of
        the same size (every node attends through one dense masked attention); the shape only sets the positions,
        here at most log2(budget + 2) levels past the context."""
        tree = cls()
        for i in range(budget):
            tree.add(ROOT if i < 2 else (i - 2) // 2, i % vocab_size, source)
        return tree

    def add(self, parent: int, token: int, source: str, q: torch.Tensor | None = None) -> int:
        """Propose `token` under `parent` (drawn from q, or deterministic when q is None); returns its node, a new one
        unless that token is already a child there. A deterministic trial of a token that already had one under this
        parent is dropped: the first one's rejection left that token probability 0, so a repeat could only be
        rejected, leaving p as it is."""
        node = self._children[parent].get(token)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
            self.sources.append(source)
            self._children[parent][token] = node
            self._children[node], self._trials[node] = {}, []
        elif q is None and any(t.node == node and t.q is None for t in self._trials[parent]):
            return node
        self._trials[parent].append(Trial(node, q))
        return node

    def merge(self, other: TokenTree) -> None:
        """Add every trial of `other` after this tree's own, each parent's in `other`'s order."""
        mapped = {ROOT: ROOT}
        for parent in [ROOT, *range(len(other))]:
            for trial in other.trials(parent):
                mapped[trial.node] = self.add(mapped[parent], other.tokens[trial.node], other.sources[trial.node],
                                              trial.q)

    def path(self, node: int) -> list[int]:
        """The nodes from the first level down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def attention_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[N+1, N+1] bool over the pending token (row and column 0) and the nodes: row i sees column j iff j is i's
        ancestor or i itself; the pending token is every node's ancestor. Feeding the pending token and the nodes
        with this mask (and every cached position visible) gives each node the logits of its own root-to-node path."""
        rows = [[True] + [False] * len(self)]
        for i, parent in enumerate(self.parents):
            row = list(rows[parent + 1])
            row[i + 1] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=device)

    def pass_inputs(self, pending: int, start: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the target's tree pass feeds (`decode.runtime.forward.ModelRunner.forward_tree`): tokens [N+1], the
        pending token then the nodes; positions [N+1], `start` for the pending token and start + depth for each node;
        and `attention_mask`."""
        tokens = torch.tensor([pending, *self.tokens], device=device)
        positions = torch.tensor([0, *self.depths], device=device) + start
        return tokens, positions, self.attention_mask(device)


@dataclass(frozen=True)
class Verdict:
    """Which candidates the target accepted: `path` (nodes from the first level down), then `next_token`, the target's
    own token after them. `tested` counts the positions at which candidates met a test: the path's length, plus one
    when the walk ended on rejections rather than at a leaf."""

    path: list[int]
    next_token: int
    tested: int


def accept_greedy(tree: TokenTree, logits: torch.Tensor) -> Verdict:
    """Greedy walk: logits [N+1, V] (row 0 for the pending token, row i+1 for node i); follow the child equal to the
    target's argmax while there is one, then the argmax. The same text as target-only greedy decoding."""
    targets = logits.argmax(-1).tolist()
    node, path, tested = ROOT, [], 0
    while True:
        tested += bool(tree.children(node))
        child = tree.child(node, targets[node + 1])
        if child is None:
            return Verdict(path, targets[node + 1], tested)
        path.append(child)
        node = child


def accept_sampled(tree: TokenTree, logits: torch.Tensor, warp: Warp, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling down the tree (SpecInfer's multi-step speculative sampling; Jeon et al. 2024 for
    siblings drawn without replacement): logits [N+1, V] as in `accept_greedy`, warped row by row as the walk reaches
    them. Each step is a speculative-sampling step whose rejection branch continues with the residual as its target,
    so this is lossless for the warped target distribution, provided every trial's token was drawn from its q given
    everything drawn before it and which trials exist never depends on their own tokens."""
    node, path, tested = ROOT, [], 0
    while True:
        p = warp(logits[node + 1])
        tested += bool(tree.trials(node))
        for trial in tree.trials(node):
            x = tree.tokens[trial.node]
            u = torch.rand((), device=p.device, generator=generator)
            q_x = 1.0 if trial.q is None else trial.q[x]
            if bool(u * q_x < p[x]):  # u < p(x) / q(x) without dividing by q
                path.append(trial.node)
                node = trial.node
                break
            p = residual(p, trial.q, x)
        else:
            return Verdict(path, int(sample(p, generator)), tested)


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """The distribution to continue with after rejecting x ~ q: norm(max(0, p − q)), q one-hot on x when None. A zero
    residual (p ≤ q everywhere, reachable only through rounding) keeps p."""
    if q is None:
        rest = p.clone()
        rest[x] = 0
    else:
        rest = (p - q).clamp_(min=0)
    mass = rest.sum()
    return rest / mass if mass > 0 else p


def accept(tree: TokenTree, logits: torch.Tensor, warp: Warp, generator: torch.Generator | None) -> Verdict:
    """The tree round's test: `accept_greedy` when greedy (no random numbers), else `accept_sampled`."""
    if warp.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, logits, warp, generator)
