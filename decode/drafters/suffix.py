"""Suffix decoding: model-free candidates from what followed the longest earlier match of the sequence's last tokens.

After SuffixDecoding (Oliaro et al., NeurIPS 2025; snowflakedb/ArcticInference): the target's earlier outputs (a
`SuffixIndex`, built once; `make distill` ships one beside the draft, `SUFFIX_INDEX_FILE`) and the current request
(`RequestTokens`) are searched for the sequence's last tokens, and the continuations with the highest estimated
probability are proposed (`SuffixSearch`). It needs no model, so it holds its stores and search apart from the
drafters that run one; `SuffixDrafter` is its chain drafter, `decode.drafters.text_trees.SuffixTree` its tree source.
How it estimates and bounds candidates: docs/concepts.md#drafters.
"""
from __future__ import annotations

import heapq
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count as counter
from pathlib import Path

import numpy as np
import torch

from pipeline.files import write_text_atomic
from pipeline.sources import SUFFIX_INDEX_FILE

END = -1  # stored before and after every sequence: never matched, and a continuation that is END is none
FORMAT = "draftops.suffix_index"
# Below these many occurrences Python beats numpy's per-call overhead: counting continuations (Counter vs np.unique),
# and extending a match one token to the left (a loop vs a masked copy).
SMALL, FEW = 256, 8


@dataclass
class Candidates:
    """A candidate tree: node i is `tokens[i]`, a child of node `parents[i]` (-1: of the sequence's last token), and
    `scores[i]` estimates the probability that the target's text reaches it. Parents come before their children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match_length: int = 0  # the length of the match the candidates continue

    @property
    def score(self) -> float:
        """The expected number of candidates the target accepts, if the estimates were right."""
        return sum(self.scores)


class SuffixIndex:
    """The target's earlier outputs (token id lists), searchable by their continuations; immutable once built.

    `tokens` holds every sequence between END markers; `order` the positions of the non-END tokens sorted by token id
    and `offsets[t]:offsets[t+1]` the slice of `order` where token t occurs.

    The counts are those of the reference's suffix tree, read from this inverted index instead: the occurrences of a
    (m+1)-token match are those of the m-token match whose preceding token is right, so each extension filters an
    array. Memory is two int32 arrays the size of the store plus one offset per token id, whatever the depth.
    """

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        tokens = np.full(int(self.lengths.sum()) + len(sequences) + 1, END, dtype=np.int32)
        starts = np.concatenate([[1], np.cumsum(self.lengths[:-1] + 1) + 1]) if len(sequences) else np.zeros(0, int)
        for start, seq in zip(starts, sequences):
            tokens[start:start + len(seq)] = seq
        if (tokens[tokens != END] < 0).any():
            raise ValueError("token ids must be >= 0")
        self.tokens, self.starts = tokens, starts
        self.order = np.argsort(tokens, kind="stable")[len(tokens) - int(self.lengths.sum()):].astype(np.int32)
        occurrences = np.bincount(tokens[tokens != END]) if self.lengths.sum() else np.zeros(0, int)
        self.offsets = np.concatenate([[0], np.cumsum(occurrences)])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def nbytes(self) -> int:
        """Memory of the arrays searched (the sequences themselves are not kept beside them)."""
        return self.tokens.nbytes + self.order.nbytes + self.offsets.nbytes + self.starts.nbytes

    def sequences(self) -> list[list[int]]:
        return [self.tokens[s:s + n].tolist() for s, n in zip(self.starts, self.lengths)]

    def after(self, token: int) -> np.ndarray:
        """The positions right after each occurrence of `token`."""
        if not 0 <= token < len(self.offsets) - 1:
            return np.zeros(0, dtype=np.int64)
        return self.order[self.offsets[token]:self.offsets[token + 1]] + 1

    def save(self, path: str | Path) -> Path:
        """JSON: {"format", "version", "sequences": [[token id, ...], ...]}; written atomically."""
        path = Path(path)
        write_text_atomic(path, json.dumps({"format": FORMAT, "version": 1, "sequences": self.sequences()},
                                           separators=(",", ":")))
        return path

    @classmethod
    def load(cls, path: str | Path) -> SuffixIndex:
        saved = json.loads(Path(path).read_text())
        if not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("version") != 1:
            raise ValueError(f"{path}: not a version 1 {FORMAT} file")
        return cls(saved["sequences"])


def load_suffix_index(draft_dir: str | Path) -> SuffixIndex | None:
    """The suffix index a draft folder carries (`SUFFIX_INDEX_FILE`), or None when it has none."""
    path = Path(draft_dir) / SUFFIX_INDEX_FILE
    return SuffixIndex.load(path) if path.exists() else None


class RequestTokens:
    """The current request's prompt and accepted tokens (the drafter's state), between END markers."""

    def __init__(self, prompt: Sequence[int]):
        self.tokens = np.full(2 * len(prompt) + 64, END, dtype=np.int32)
        self.length = 0  # tokens held, stored from position 1
        self.extend(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        end = 1 + self.length + len(tokens)
        if end + 1 > len(self.tokens):
            grown = np.full(2 * end, END, dtype=np.int32)
            grown[:len(self.tokens)] = self.tokens
            self.tokens = grown
        self.tokens[1 + self.length:end] = tokens
        self.length += len(tokens)

    def sync(self, seq: Sequence[int]) -> None:
        """Take the tokens of `seq` past those held (the decoder's sequence only grows between rollbacks)."""
        if len(seq) > self.length:
            self.extend(seq[self.length:])

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.tokens[1 + length:1 + self.length] = END
            self.length = length

    def after(self, token: int) -> np.ndarray:
        """The positions right after each occurrence of `token` but the last position: the request's last position
        has no continuation yet, and counting it (as the reference does) would halve every estimate from the
        request."""
        return np.flatnonzero(self.tokens[1:self.length] == token) + 2


def match(store, context: Sequence[int], longest: int) -> list[np.ndarray]:
    """ends[m - 1]: the positions right after each occurrence of context's last m tokens in `store`, for m = 1 up to
    the longest match (at most `longest`). Levels with the same occurrences share one array."""
    limit = min(longest, len(context))
    if limit < 1:
        return []
    ends = store.after(context[-1])
    found: list[np.ndarray] = []
    while ends.size > FEW:
        found.append(ends)
        if len(found) == limit:
            return found
        m = len(found)
        ends = ends[store.tokens[ends - m - 1] == context[-m - 1]]
    # a few occurrences of the last len(found) + 1 tokens: extend each one to the left on its own
    reach = {}
    for end in ends.tolist():
        m = len(found) + 1
        while m < limit and store.tokens[end - m - 1] == context[-m - 1]:
            m += 1
        reach[end] = m
    for _ in range(len(found), max(reach.values(), default=0)):
        keep = [end for end, m in reach.items() if m > len(found)]
        found.append(found[-1] if found and found[-1].size == len(keep) else np.array(keep))
    return found
def continuations(tokens: np.ndarray, ends: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The tokens that follow `ends` with their counts, most frequent first (then by id), and the tokens themselves."""
    following = tokens[ends]
    if ends.size <= SMALL:
        counts = Counter(following.tolist())
        counts.pop(END, None)
        pairs = list(counts.items())
    else:
        ids, numbers = np.unique(following[following != END], return_counts=True)
        pairs = list(zip(ids.tolist(), numbers.tolist()))
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    return pairs, following


def grow(tokens: np.ndarray, ends: np.ndarray, budget: int, min_prob: float, tree: bool,
         depth: int | None = None) -> Candidates:
    """Candidates continuing the match whose occurrences end at `ends`, at most `budget` nodes of at most `depth`
    levels (None: any; a node at the last level gets no children).

    tree: each node taken is the most probable of all the continuations of the nodes taken so far (a heap, as the
    reference's `_speculate_tree`); else the chain that follows the most frequent continuation at every step.
    """
    out = Candidates()
    order = counter()
    heap: list = []  # (-probability, tie-break, token, parent node, parent's occurrences, what followed them)

    def expand(node_ends: np.ndarray, prob: float, node: int) -> None:
        pairs, following = continuations(tokens, node_ends)
        for token, number in pairs if tree else pairs[:1]:
            # a match that ends its sequence counts in the denominator: it says the text may stop there
            child = prob * number / node_ends.size
            if child < min_prob:
                break
            heapq.heappush(heap, (-child, next(order), token, node, node_ends, following))

    expand(ends, 1.0, -1)
    depths: list[int] = []
    while heap and len(out.tokens) < budget:
        minus_prob, _, token, parent, parent_ends, following = heapq.heappop(heap)
        out.tokens.append(token)
        out.parents.append(parent)
        out.scores.append(-minus_prob)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if len(out.tokens) < budget and (depth is None or depths[-1] < depth):
            expand(parent_ends[following == token] + 1, -minus_prob, len(out.tokens) - 1)
    return out


@dataclass(frozen=True)
class SuffixSearch:
    """The search's settings (the reference's names and defaults: ArcticInference's suffix decoding)."""

    # matches are shorter than max_depth; the reference's tree bounds match + continuation by it, which differs only
    # for matches within a budget of max_depth (here the budget bounds continuations)
    max_depth: int = 64
    max_spec_factor: float = 1.0  # a match of m tokens is continued by at most max_spec_factor·m + max_spec_offset
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # candidates whose estimated probability is lower are not proposed

    def budget(self, match_length: int, budget: int) -> int:
        return max(0, min(budget, int(match_length * self.max_spec_factor + self.max_spec_offset + 1e-6)))

    def best(self, store, context: Sequence[int], budget: int, tree: bool, depth: int | None,
             beat: Candidates) -> Candidates:
        """The best candidates from `store` that score higher than `beat`, else `beat`. Longest match first: a match of
        m tokens scores at most its budget, so shorter ones stop being tried once that is no more than the best; and
        a shorter match with the same occurrences and budget as a longer one grows the same candidates (the longer
        wins the tie), so it is skipped."""
        best = beat
        found = match(store, context, self.max_depth - 1)
        longer = None  # (occurrences, budget) of the match one token longer
        for m in range(len(found), 0, -1):
            limit = self.budget(m, budget)
            if limit <= best.score:
                break
            if longer == (found[m - 1].size, limit):
                continue
            longer = (found[m - 1].size, limit)
            candidates = grow(store.tokens, found[m - 1], limit, self.min_token_prob, tree, depth)
            if candidates.score > best.score:
                candidates.match_length = m
                best = candidates
        return best

    def candidates(self, index: SuffixIndex | None, request: RequestTokens, budget: int, *,
                   tree: bool = True, depth: int | None = None) -> Candidates:
        """The request's best candidates of at most `budget` tokens and `depth` levels (None: any), from the request
        itself and the index; the request is searched first, so it wins a tie. Unlike the reference, the request is
        searched as a sequence, not kept as a tree."""
        context = request.tokens[max(1, 1 + request.length - self.max_depth):1 + request.length].tolist()
        best = self.best(request, context, budget, tree, depth, Candidates())
        return best if index is None else self.best(index, context, budget, tree, depth, best)


class SuffixDrafter:
    """Suffix decoding as a drafter: `model_decoder(target, SuffixDrafter.for_model(target, index), γ)`
    (`decode.factory`)."""

    context = None  # no positions of its own: the target's context is the limit
    feature_layers = ()

    def __init__(self, index: SuffixIndex | None, vocab_size: int | None, device: torch.device | str = "cpu",
                 search: SuffixSearch = SuffixSearch()):
        """vocab_size, device: of the target's one-hot q in `propose`; None for a tree source (`SuffixTree`), which
        only searches."""
        self.index, self.vocab_size, self.device, self.search = index, vocab_size, torch.device(device), search
        self.name = "suffix(request only, no index)" if index is None else f"suffix(index of {len(index)} sequences)"

    @classmethod
    def for_model(cls, target, index: SuffixIndex | None, **kwargs) -> SuffixDrafter:
        return cls(index, target.get_output_embeddings().weight.shape[0], next(target.parameters()).device, **kwargs)

    def start(self, prompt: list[int]) -> RequestTokens:
        return RequestTokens(prompt)

    def candidates(self, state: RequestTokens, seq: list[int], budget: int, depth: int | None = None) -> Candidates:
        """The candidate tree of at most `budget` tokens and `depth` levels (None: any) after `seq`."""
        state.sync(seq)
        return self.search.candidates(self.index, state, budget, tree=True, depth=depth)

    def propose(self, state: RequestTokens, seq: list[int], k: int, warp, generator):
        """(drafts [k'], one-hot q [k', V] (None when greedy), 0 model forwards): the most probable chain, k' <= k.
        Deterministic, so the decoder's test with a one-hot q stays lossless."""
        state.sync(seq)
        chain = self.search.candidates(self.index, state, k, tree=False).tokens
        drafts = torch.tensor(chain, dtype=torch.long, device=self.device)
        q = None if warp.greedy else torch.nn.functional.one_hot(drafts, self.vocab_size).float()
        return drafts, q, 0

    def rollback(self, state: RequestTokens, length: int) -> None:
        state.truncate(length)
