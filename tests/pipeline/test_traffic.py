import json

import pytest

from pipeline.traffic import DEFAULT_TRAFFIC, TrafficError, encode_prompts, load_traffic, split_of


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


THREE_SHAPES = [
    {"id": "a", "category": "chat", "messages": [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hello world"}]},
    {"id": "b", "category": "code", "prompt": "write python code"},
    {"id": "c", "turns": ["what is two", "and three"]},
    {"prompt": "no id here"},
]


def test_all_three_shapes_load(tmp_path):
    traffic = load_traffic(write_lines(tmp_path / "t.jsonl", THREE_SHAPES))
    by_id = {r.id: r for r in traffic.requests}
    assert by_id["a"].messages[-1] == {"role": "user", "content": "hello world"} and len(by_id["a"].messages) == 2
    assert by_id["b"].messages == ({"role": "user", "content": "write python code"},)
    assert (by_id["c"].messages == ({"role": "user", "content": "what is two"},)
            and by_id["c"].category == "uncategorized")
    no_id = [r for r in traffic.requests if r.id.startswith("sha-")]
    assert len(no_id) == 1 and no_id[0].line == 4


@pytest.mark.parametrize("bad, reason", [
    ("{not json", "Expecting property name"),
    (json.dumps({"id": "x"}), "exactly one of"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
     "last message must come from the user"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), "needs a role"),
    (json.dumps({"prompt": "  "}), "non-empty string"),
    (json.dumps({"id": "a", "prompt": "dup"}), "duplicate id"),
])
def test_broken_line_names_file_and_line_or_is_counted(tmp_path, bad, reason):
    path = write_lines(tmp_path / "t.jsonl", THREE_SHAPES[:2] + [bad] + THREE_SHAPES[2:])
    with pytest.raises(TrafficError) as err:
        load_traffic(path)
    assert str(err.value).startswith(f"{path}:3: ") and reason in str(err.value)
    traffic = load_traffic(path, skip_malformed=True)
    assert len(traffic.requests) == 4 and len(traffic.malformed) == 1 and traffic.malformed[0].startswith(f"{path}:3:")


def test_heldout_split_is_stable_when_the_log_grows(tmp_path):
    records = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(500)]
    path = write_lines(tmp_path / "t.jsonl", records)
    before = [r.id for r in load_traffic(path).split("heldout")]
    write_lines(path, records + [{"id": f"new{i}", "prompt": f"later {i}"} for i in range(1000)])
    grown = load_traffic(path)
    after = [r.id for r in grown.split("heldout") if not r.id.startswith("new")]
    assert after == before
    assert 0.06 < len(grown.split("heldout")) / len(grown.requests) < 0.14  # about the configured 10%
    assert split_of("r1", 0.1) == split_of("r1", 0.1)


def test_shipped_default_traffic_is_rich_enough():
    traffic = load_traffic(DEFAULT_TRAFFIC)
    categories = traffic.categories()
    assert len(traffic.requests) >= 300 and not traffic.malformed
    assert {"code", "math", "writing", "qa", "summarization", "translation", "chat"} <= set(categories)
    assert min(categories.values()) >= 30
    assert len(traffic.split("heldout")) >= 20


def test_prompts_get_the_chat_template_and_long_ones_are_truncated(tmp_path, tiny_tokenizer):
    traffic = load_traffic(write_lines(tmp_path / "t.jsonl", THREE_SHAPES))
    ids, truncated = encode_prompts(traffic.requests, tiny_tokenizer, max_prompt_tokens=512)
    assert truncated == 0
    assert tiny_tokenizer.decode(ids[1]) == "<|im_start|> user write python code <|im_end|> <|im_start|> assistant"
    assert [len(x) for x in ids] == [12, 8, 8, 8]
    with pytest.warns(UserWarning, match="4 of 4 prompts"):
        short, truncated = encode_prompts(traffic.requests, tiny_tokenizer, max_prompt_tokens=7)
    assert truncated == 4 and [len(x) for x in short] == [7, 7, 7, 7] and short[0] == ids[0][-7:]


def test_first_per_category_keeps_log_order():
    from pipeline.traffic import Request, first_per_category

    requests = [Request(str(i), c, ({"role": "user", "content": "x"},)) for i, c in enumerate("aabbbacc")]
    assert [r.id for r in first_per_category(requests, 2)] == ["0", "1", "2", "3", "6", "7"]


def test_a_non_utf8_byte_names_its_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [(r if isinstance(r, str) else json.dumps(r)).encode() for r in THREE_SHAPES]
    path.write_bytes(b"\n".join(lines[:1] + [b'{"prompt": "caf\xe9"}'] + lines[1:]) + b"\n")
    with pytest.raises(TrafficError) as err:
        load_traffic(path)
    assert str(err.value).startswith(f"{path}:2: ") and "utf-8" in str(err.value)
    assert len(load_traffic(path, skip_malformed=True).requests) == len(THREE_SHAPES)
