"""Prompt lookup (n-gram) drafting: no draft model, the proposals are copied from the text so far.

The drafter finds the most recent earlier occurrence of the sequence's last n tokens (longest n first) and proposes
the tokens that followed it (Saxena 2023, "prompt lookup decoding"; HF's PromptLookupCandidateGenerator). A proposal
is a deterministic function of the prefix, so its q is one-hot and the min(1, p/q) test stays lossless: a draft x is
accepted with probability p(x), and a rejection resamples from p with x removed.
"""

from __future__ import annotations

import torch

PROMPT_LOOKUP = "prompt-lookup"  # the draft "source" that names this drafter on the command line


class PromptLookupDrafter:
    """Model-free drafter for `model_decoder(target, PromptLookupDrafter.for_model(target), γ)` (`decode.factory`)."""

    context = None  # no positions of its own: the target's context is the limit
    feature_layers = ()

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", *, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"lookup(n={min_ngram}..{max_ngram})"

    @classmethod
    def for_model(cls, target, **kwargs) -> PromptLookupDrafter:
        return cls(target.get_output_embeddings().weight.shape[0], next(target.parameters()).device, **kwargs)

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of seq's last n tokens (n = max_ngram..min_ngram)."""
        if k < 1 or len(seq) < 2:
            return []
        tokens = torch.tensor(seq)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = tokens[:-1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == tokens[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return seq[start : start + k]
        return []

    def start(self, prompt: list[int]) -> None:
        return None

    def propose(self, state, seq: list[int], k: int, warp, generator):
        """(drafts [k'], one-hot q [k', V] (None when greedy), 0 model forwards); k' < k when the match runs out or
        nothing matches."""
        drafts = torch.tensor(self.lookup(seq, k), dtype=torch.long, device=self.device)
        q = None if warp.greedy else torch.nn.functional.one_hot(drafts, self.vocab_size).float()
        return drafts, q, 0

    def rollback(self, state, length: int) -> None:
        pass


def lookup_max_ngram(min_ngram: int) -> int:
    """The longest n-gram the decoder's prompt lookup matches first, given the shortest it accepts."""
    return max(3, min_ngram)


def lookup_first_drafter(vocab_size: int, device, min_ngram: int) -> PromptLookupDrafter:
    """The lookup half of `LookupThenModelDrafter`: matches of min_ngram tokens or more, the longest up to
    `lookup_max_ngram` first."""
    return PromptLookupDrafter(vocab_size, device, max_ngram=lookup_max_ngram(min_ngram), min_ngram=min_ngram)


class LookupThenModelDrafter:
    """Prompt lookup where the text so far repeats itself, the draft model everywhere else.

    Copying costs nothing and is often long where a small draft is weak (summaries, retrieved passages, code edits),
    while the model covers free text. A round takes the lookup's proposal when an n-gram of at least `lookup.min_ngram`
    tokens matches, else asks the model. The model's cache simply misses the tokens of lookup rounds: its next
    proposal feeds them first, in one forward.
    """

    def __init__(self, lookup: PromptLookupDrafter, model_drafter):
        self.lookup, self.model = lookup, model_drafter
        self.context, self.feature_layers = model_drafter.context, model_drafter.feature_layers
        self.name = f"{lookup.name}+{model_drafter.name}"

    def start(self, prompt: list[int]):
        return self.model.start(prompt)

    def propose(self, state, seq: list[int], k: int, warp, generator):
        drafts, q, _ = self.lookup.propose(None, seq, k, warp, generator)
        if drafts.numel():
            return drafts, q, 0
        return self.model.propose(state, seq, k, warp, generator)

    def rollback(self, state, length: int) -> None:
        self.model.rollback(state, length)

    def observe(self, state, features: torch.Tensor) -> None:
        """The target's hidden states, for a feature draft: it reads them in lookup rounds too."""
        self.model.observe(state, features)
