"""On-policy data: continuations the draft itself samples from training prompts (GKD's idea: train the draft on the
prefixes it produces at decode time, not only on the target's). They carry no cached teacher, so the target
scores them online.
"""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from distill.data.responses import ResponseSet, left_pad
from pipeline.sources import eos_token_ids


class FullVocabHead(torch.nn.Module):
    """Wraps a reduced lm_head so `generate` sees target-vocabulary logits (the lowest float outside the subset)."""

    def __init__(self, head: torch.nn.Module, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head, self.token_ids, self.vocab_size = head, token_ids, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.head(hidden)
        full = rows.new_full((*rows.shape[:-1], self.vocab_size), torch.finfo(rows.dtype).min)
        return full.index_copy(-1, self.token_ids.to(rows.device), rows)


@torch.no_grad()
def draft_continuations(draft, tokenizer, prompts: list[list[int]], *, token_ids, max_new_tokens: int,
                        temperature: float, seed: int) -> ResponseSet:
    """Continuations sampled from the current draft (the on-policy share of the data); no teacher attached."""
    stop = eos_token_ids(draft, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    head = draft.lm_head
    if token_ids is not None:
        draft.lm_head = FullVocabHead(head, token_ids, draft.get_input_embeddings().num_embeddings)
    was_training = draft.training
    try:
        draft.eval()
        ids, mask = left_pad(prompts, pad_id, next(draft.parameters()).device)
        torch.manual_seed(seed)
        out = draft.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=None, top_p=None,
            eos_token_id=stop, pad_token_id=pad_id))
    finally:
        draft.lm_head = head
        draft.train(was_training)
    responses = []
    for tokens in out[:, ids.shape[1]:].tolist():
        length = next((t + 1 for t, tok in enumerate(tokens) if tok in stop), len(tokens))
        responses.append(tokens[:length])
    return ResponseSet([str(i) for i in range(len(prompts))], [list(p) for p in prompts], responses)
