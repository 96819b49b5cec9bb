"""Whatever a production log holds, every line is a request or a `file:line` error: deep nesting, lone surrogates,
huge lines; and a huge request costs memory by the configuration, not by its size."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.traffic import (
    TrafficError,
    TruncationWarning,
    cut_messages,
    encode_prompts,
    load_traffic,
    parse_line,
    prompt_char_bound,
)

REPO = Path(__file__).resolve().parents[2]
GOOD = [{"id": "a", "prompt": "hello world"}, {"id": "b", "prompt": "write python code"}]


def write(path: Path, lines: list) -> Path:
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


@pytest.mark.parametrize("bad, reason", [
    ("[" * 200_000 + "]" * 200_000, "nested deeper"),
    ('{"prompt": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested deeper"),
    ('{"prompt": "\\ud800 hi"}', "lone UTF-16 surrogate"),
    ('{"id": "\\udfff", "prompt": "hi"}', "lone UTF-16 surrogate"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc80"}]}]}', "surrogate"),
    ('{"prompt": "hi", "ts": 1e308}', "out of range"),
    ('{"prompt": "hi", "id": ' + "9" * 5000 + "}", "digits"),
])
def test_a_hostile_line_is_a_file_line_error_and_skipped_when_asked(tmp_path, bad, reason):
    path = write(tmp_path / "t.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.raises(TrafficError) as err:
        load_traffic(path)
    assert str(err.value).startswith(f"{path}:2: ") and reason in str(err.value)
    traffic = load_traffic(path, skip_malformed=True)
    assert [r.id for r in traffic.requests] == ["a", "b"] and traffic.malformed[0].startswith(f"{path}:2: ")


def test_a_lone_surrogate_never_reaches_the_tokenizer(tmp_path, tiny_tokenizer):
    traffic = load_traffic(write(tmp_path / "t.jsonl", [GOOD[0], '{"prompt": "\\ud800 hi"}']), skip_malformed=True)
    ids, _ = encode_prompts(traffic.requests, tiny_tokenizer, 64)  # the tokenizer raised TypeError on it
    assert len(ids) == 1 and len(traffic.malformed) == 1


def test_a_line_over_max_line_bytes_is_malformed_and_never_read_whole(tmp_path):
    path = write(tmp_path / "t.jsonl", [GOOD[0], {"id": "big", "prompt": "x " * 300_000}, GOOD[1]])
    traffic = load_traffic(path, skip_malformed=True, max_line_bytes=100_000)
    assert [r.id for r in traffic.requests] == ["a", "b"]
    assert traffic.malformed == [f"{path}:2: a line longer than traffic.max_line_bytes=100000"]
    no_newline = tmp_path / "tail.jsonl"
    no_newline.write_text(json.dumps(GOOD[0]) + "\n" + "y" * 250_000)
    assert len(load_traffic(no_newline, skip_malformed=True, max_line_bytes=100_000).malformed) == 1


def test_a_huge_conversation_keeps_its_end_and_its_identity(tmp_path, tiny_tokenizer):
    messages = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "one " * 1000 + "two"})
    cut, dropped = cut_messages(messages, 10)
    assert cut == ({"role": "user", "content": "ne one two"},) and dropped == 8 + 4003 - 10
    assert sum(len(m["content"]) for m in cut) == 10 and cut_messages(messages, 10_000) == (messages, 0)
    line = {"prompt": "hello " * 10_000 + "world"}
    path = write(tmp_path / "t.jsonl", [line])
    whole, kept = load_traffic(path).requests[0], load_traffic(path, max_prompt_chars=prompt_char_bound(16)).requests[0]
    assert kept.id == whole.id and kept.cut > 0 and kept.messages[0]["content"].endswith("hello world")
    with pytest.warns(TruncationWarning):
        (full_ids,), _ = encode_prompts([whole], tiny_tokenizer, 16)
        (cut_ids,), truncated = encode_prompts([kept], tiny_tokenizer, 16)
    assert cut_ids == full_ids and truncated == 1  # the same last 16 tokens, and counted as truncated


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from pipeline.traffic import encode_prompts, load_traffic
    vocab = {"<|im_start|>": 0, "<|im_end|>": 1, "user": 2, "assistant": 3, "hello": 4, "world": 5, "[UNK]": 6}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                               "{% endfor %}<|im_start|>assistant ")
    traffic = load_traffic(sys.argv[1], skip_malformed=True)
    ids, truncated = encode_prompts(traffic.requests, tokenizer, 512)
    print(len(ids), truncated, max(len(i) for i in ids), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def test_a_50_mb_request_is_cut_before_it_is_tokenized_under_a_2_gb_limit(tmp_path):
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps(GOOD[0]) + "\n")
        f.write(json.dumps({"id": "huge", "prompt": "hello world " * (50_000_000 // 12)}) + "\n")
    assert path.stat().st_size > 50_000_000
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), str(2 << 30)], cwd=REPO, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]  # tokenized whole, it needed more than 2 GB and aborted (134)
    count, truncated, longest, max_rss_kb = out.stdout.split()
    assert (count, truncated, longest) == ("2", "1", "512") and int(max_rss_kb) < 2 << 20  # under 2 GiB


# --------------------------------------------------------------------------- fuzzing

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "id", "x"]) | st.text(
                         max_size=5), inner, max_size=3), max_leaves=8)
_roles = st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", None, 3])
_message = st.fixed_dictionaries({"role": _roles, "content": st.one_of(
    st.text(max_size=20), st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", 5]), "text": st.one_of(st.text(max_size=10), st.none())}),
        max_size=2))})
_request = st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.text(max_size=8), st.integers(), st.booleans(), _json),
    "request_id": st.text(max_size=4), "category": st.one_of(st.text(max_size=6), st.integers()),
    "ts": st.one_of(st.text(max_size=25), st.floats(), st.integers(-10**20, 10**20), st.just("2026-10-01T02:00Z")),
    "messages": st.one_of(st.lists(_message, max_size=3), _json), "prompt": st.one_of(st.text(max_size=20), _json),
    "turns": st.one_of(st.lists(st.text(max_size=8), max_size=2), _json),
    "body": st.one_of(st.text(max_size=30), _json)})


_line = st.one_of(
    _request.map(json.dumps),
    _request.map(lambda r: json.dumps(r, ensure_ascii=False)),
    _json.map(json.dumps),
    st.text(max_size=40),  # anything at all: control characters, surrogates, quotes
    st.builds(lambda depth, inner: "[" * depth + inner + "]" * depth, st.integers(900, 5000), st.just("1")),
    st.builds(lambda n: '{"prompt": "\\ud' + n + '00 x"}', st.sampled_from(["8", "b", "c", "f"])),
)


def test_fuzz_every_line_is_a_request_or_a_file_line_error(tmp_path_factory):
    """60 logs of 40 generated lines (2,400 lines, counted): each is kept, a retry, or a `file:line` error; never
    another exception."""
    lines_seen = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
    @given(st.lists(_line, min_size=40, max_size=40))
    def one_log(lines):
        path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write("".join(line.replace("\n", " ").replace("\r", " ") + "\n" for line in lines))
        lines_read = sum(1 for raw in path.read_bytes().split(b"\n")[:-1] if raw.strip())
        lines_seen.append(len(lines))
        try:
            traffic = load_traffic(path, skip_malformed=True, max_prompt_chars=prompt_char_bound(8))
        except TrafficError as exc:
            assert str(exc) == f"{path}: no valid requests"
            return
        assert len(traffic.requests) + traffic.duplicates + len(traffic.malformed) == lines_read
        assert all(reason.startswith(f"{path}:") for reason in traffic.malformed)
        for request in traffic.requests:
            json.dumps(request.messages).encode("utf-8")
            assert sum(len(m["content"]) for m in request.messages) <= prompt_char_bound(8)

    one_log()
    assert sum(lines_seen) >= 2000


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_fuzz_parse_line_raises_only_value_errors(text):
    try:
        parse_line(text)
    except ValueError:
        pass
