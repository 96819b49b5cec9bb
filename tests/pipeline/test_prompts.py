"""What reaches the chat template: the request's tools, its reasoning as `traffic.reasoning` says, and the engine's
own template given as a file (`traffic.chat_template`)."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.prompts import PromptStyle, prompt_style, render
from pipeline.traffic import Request, TrafficError, encode_configured, load_traffic
from tests.conftest import make_tokenizer

# prints its tools, then the conversation
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}| {% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
# Qwen3's handling of thinking, cut to it: reasoning_content rendered as a think block, and an empty think block
# after the generation prompt when enable_thinking is false
QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
THOUGHTFUL = ({"role": "user", "content": "Two plus two?"},
              {"role": "assistant", "content": "Four.", "reasoning_content": "2 + 2 = 4"},
              {"role": "user", "content": "And three plus three?"})


def test_the_requests_tools_reach_the_template(tmp_path):
    tokenizer = make_tokenizer()
    line = {"id": "t", "tools": [WEATHER], "messages": [{"role": "user", "content": "weather in Paris?"}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(line) + "\n")
    request = load_traffic(tmp_path / "t.jsonl").requests[0]
    text = render(request.messages, tokenizer, PromptStyle(chat_template=TOOLS_TEMPLATE), request.tools)
    assert text == "TOOLS get_weather | <user>weather in Paris?<assistant>"
    bare = render(request.messages, tokenizer, PromptStyle(chat_template=TOOLS_TEMPLATE))
    assert "TOOLS" not in bare


@pytest.mark.parametrize("reasoning, earlier, closing", [
    ("template", "<think>\n2 + 2 = 4\n</think>\n\nFour.", "<|im_start|>assistant\n"),
    ("keep", "<think>\n2 + 2 = 4\n</think>\n\nFour.", "<|im_start|>assistant\n"),
    ("strip", "\nFour.<|im_end|>", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])
def test_reasoning_and_enable_thinking_reach_a_qwen3_style_template(reasoning, earlier, closing):
    text = render(THOUGHTFUL, make_tokenizer(), PromptStyle(reasoning, QWEN3_STYLE))
    assert earlier in text and text.endswith(closing)
    if reasoning == "strip":
        assert "2 + 2" not in text


def test_strip_drops_think_blocks_logged_in_the_text():
    logged = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>greet</think>\nHello"},
              {"role": "user", "content": "bye"})
    assert "greet" not in render(logged, make_tokenizer(), PromptStyle("strip", TOOLS_TEMPLATE))
    assert "<think>greet</think>" in render(logged, make_tokenizer(), PromptStyle("keep", TOOLS_TEMPLATE))


def test_the_engines_template_file_is_what_prompts_are_encoded_with(tmp_path):
    (tmp_path / "engine.jinja").write_text(TOOLS_TEMPLATE)
    cfg = load_config(None, [f"traffic.chat_template={tmp_path / 'engine.jinja'}", "traffic.reasoning=strip"])
    assert prompt_style(cfg.traffic) == PromptStyle("strip", TOOLS_TEMPLATE)
    tokenizer = make_tokenizer()
    request = Request("r", "x", ({"role": "user", "content": "hello"},), tools=(WEATHER,))
    ids, _ = encode_configured([request], tokenizer, cfg.traffic)
    assert ids[0] == tokenizer("TOOLS get_weather | <user>hello<assistant>", add_special_tokens=False)["input_ids"]
    missing = load_config(None, [f"traffic.chat_template={tmp_path / 'none.jinja'}"])
    with pytest.raises(TrafficError, match=r"^traffic.chat_template: .*none.jinja: cannot be read"):
        encode_configured([request], tokenizer, missing.traffic)
