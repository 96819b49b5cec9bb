"""Prompts as the models read them: a logged conversation cut to what the token budget can use, its chat template,
its token ids.

A conversation is cut to `prompt_char_bound(max_prompt_tokens)` characters (its end kept) before the tokenizer sees
it: a fast tokenizer holds offsets, masks and words for every token, many times the request's own size, while the
prompt keeps only its last `max_prompt_tokens` tokens anyway.

What the template sees (`PromptStyle`, from the `traffic:` section): the request's `tools`, its reasoning as
`traffic.reasoning` says, and the template itself, the tokenizer's or the engine's own (`traffic.chat_template`, a
Jinja file, as vLLM's and SGLang's `--chat-template` take it): what the draft must predict is what the engine renders.
- reasoning `template`: the messages as logged (`reasoning_content` a field, think blocks in the text), the
  template's own default for thinking: the template decides what to render;
- `keep`: an assistant's `reasoning_content` written into its text as a `<think>` block, and the template's
  `enable_thinking` on: the target thinks, and earlier replies keep their thoughts;
- `strip`: think blocks and `reasoning_content` dropped, `enable_thinking` off. A template that does not read
  `enable_thinking` ignores it.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.traffic_sources import TrafficError

if TYPE_CHECKING:
    from pipeline.traffic import Request

# Characters kept per token of the prompt budget before tokenizing: generous, since a token of a BPE vocabulary
# rarely spans more than 16 characters; a prompt cut there still yields its last `max_prompt_tokens` tokens.
CHARS_PER_TOKEN_BOUND = 32
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
REASONING_FIELD = "reasoning_content"


@dataclass(frozen=True)
class PromptStyle:
    """How a conversation becomes the template's input: reasoning (keep | strip | template) and the Jinja template
    (None: the tokenizer's)."""

    reasoning: str = "template"
    chat_template: str | None = None


def prompt_style(traffic_cfg) -> PromptStyle:
    """The `traffic:` section's style (a `pipeline.config.TrafficConfig`), its template file read."""
    template = None
    if traffic_cfg.chat_template:
        path = Path(traffic_cfg.chat_template)
        try:
            template = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TrafficError(f"traffic.chat_template: {path}: cannot be read: {exc}") from None
    return PromptStyle(traffic_cfg.reasoning, template)


def styled_message(message: dict, reasoning: str) -> dict:
    """An assistant message as `reasoning` has it (other messages as they are)."""
    if message["role"] != "assistant" or reasoning == "template":
        return message
    out = {key: value for key, value in message.items() if key != REASONING_FIELD}
    if reasoning == "strip":
        out["content"] = THINK_BLOCK.sub("", message["content"])
    elif message.get(REASONING_FIELD):
        out["content"] = f"<think>\n{message[REASONING_FIELD].strip()}\n</think>\n\n{message['content']}"
    return out


def template_arguments(tools, style: PromptStyle | None) -> dict:
    """apply_chat_template's arguments besides the messages: tools, thinking, the template (only those set)."""
    out: dict = {"tools": list(tools)} if tools else {}
    if style is not None:
        if style.reasoning != "template":
            out["enable_thinking"] = style.reasoning == "keep"
        if style.chat_template is not None:
            out["chat_template"] = style.chat_template
    return out


def render(messages, tokenizer, style: PromptStyle | None, tools=None, *, generation_prompt: bool = True) -> str:
    """The conversation as the template renders it, with the generation prompt (or not: a finished reply)."""
    styled = [styled_message(m, style.reasoning) for m in messages] if style is not None else list(messages)
    return tokenizer.apply_chat_template(styled, add_generation_prompt=generation_prompt, tokenize=False,
                                         **template_arguments(tools, style))


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


def encode_prompt(request: Request, tokenizer, max_prompt_tokens: int, style: PromptStyle | None = None) -> list[int]:
    """Chat template with the generation prompt (`render`); an over-long prompt keeps its last tokens (with a
    warning). The conversation is cut to `prompt_char_bound(max_prompt_tokens)` characters first: tokenizing all of
    a huge request would cost gigabytes."""
    messages, cut = cut_messages(request.messages, prompt_char_bound(max_prompt_tokens))
    text = render(messages, tokenizer, style, request.tools)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens or cut or request.cut:
        warnings.warn(f"request {request.id}: prompt of {len(ids)} tokens"
                      f"{' (after cutting ' + str(cut + request.cut) + ' characters)' if cut or request.cut else ''}"
                      f" truncated to its last {max_prompt_tokens}", TruncationWarning, stacklevel=2)
        ids = ids[-max_prompt_tokens:]
    return ids


def encode_prompts(requests: list[Request], tokenizer, max_prompt_tokens: int,
                   style: PromptStyle | None = None) -> tuple[list[list[int]], int]:
    """Encode many prompts; returns the ids and how many were truncated (reported once, not per request)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        encoded = [encode_prompt(r, tokenizer, max_prompt_tokens, style) for r in requests]
    truncated = sum(issubclass(w.category, TruncationWarning) for w in caught)
    if truncated:
        warnings.warn(f"{truncated} of {len(requests)} prompts were longer than {max_prompt_tokens} tokens "
                      "and were truncated", TruncationWarning, stacklevel=2)
    return encoded, truncated
