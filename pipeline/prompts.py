"""Prompts as the models read them: a logged conversation cut to what the token budget can use, its chat template,
its token ids.

A conversation is cut to `prompt_char_bound(max_prompt_tokens)` characters (its end kept) before the tokenizer sees
it: a fast tokenizer holds offsets, masks and words for every token, many times the request's own size, while the
prompt keeps only its last `max_prompt_tokens` tokens anyway.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.traffic import Request

# Characters kept per token of the prompt budget before tokenizing: generous, since a token of a BPE vocabulary
# rarely spans more than 16 characters; a prompt cut there still yields its last `max_prompt_tokens` tokens.
CHARS_PER_TOKEN_BOUND = 32


class TruncationWarning(UserWarning):
    """A prompt longer than the configured context was cut; callers count these."""


def cut_messages(messages: tuple[dict, ...], max_chars: int) -> tuple[tuple[dict, ...], int]:
    """The conversation's last `max_chars` characters of content: earlier messages dropped whole, the first one kept
    cut to its end (as an over-long prompt keeps its last tokens). Returns (messages, characters dropped)."""
    total = sum(len(m["content"]) for m in messages)
    if total <= max_chars:
        return messages, 0
    kept: list[dict] = []
    room = max_chars
    for message in reversed(messages):
        if room <= 0:
            break
        content = message["content"]
        kept.append(message if len(content) <= room else {**message, "content": content[len(content) - room:]})
        room -= len(content)
    kept.reverse()
    return tuple(kept), total - sum(len(m["content"]) for m in kept)


def prompt_char_bound(max_prompt_tokens: int) -> int:
    """The characters a prompt keeps before it is tokenized: enough for its last `max_prompt_tokens` tokens."""
    return max(max_prompt_tokens, 1) * CHARS_PER_TOKEN_BOUND


def encode_prompt(request: Request, tokenizer, max_prompt_tokens: int) -> list[int]:
    """Chat template with the generation prompt; an over-long prompt keeps its last tokens (with a warning). The
    conversation is cut to `prompt_char_bound(max_prompt_tokens)` characters first: tokenizing all of a huge request
    would cost gigabytes."""
    messages, cut = cut_messages(request.messages, prompt_char_bound(max_prompt_tokens))
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens or cut or request.cut:
        warnings.warn(f"request {request.id}: prompt of {len(ids)} tokens"
                      f"{' (after cutting ' + str(cut + request.cut) + ' characters)' if cut or request.cut else ''}"
                      f" truncated to its last {max_prompt_tokens}", TruncationWarning, stacklevel=2)
        ids = ids[-max_prompt_tokens:]
    return ids


def encode_prompts(requests: list[Request], tokenizer, max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Encode many prompts; returns the ids and how many were truncated (reported once, not per request)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        encoded = [encode_prompt(r, tokenizer, max_prompt_tokens) for r in requests]
    truncated = sum(issubclass(w.category, TruncationWarning) for w in caught)
    if truncated:
        warnings.warn(f"{truncated} of {len(requests)} prompts were longer than {max_prompt_tokens} tokens "
                      "and were truncated", TruncationWarning, stacklevel=2)
    return encoded, truncated
