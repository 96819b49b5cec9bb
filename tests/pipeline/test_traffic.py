import gzip
import json
from datetime import datetime, timezone

import pytest

from pipeline.traffic import DEFAULT_TRAFFIC, TrafficError, chronological, encode_prompts, load_traffic, split_of
from tests.conftest import shared_data


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
    (json.dumps({"messages": [{"role": "assistant", "content": "yo"}]}), "last message must come from the user"),
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


def test_spec_bench_question_file_reads_as_published(tmp_path):
    path = write_lines(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "writing", "turns": ["Draft a professional email."]},
        {"question_id": 161, "category": "math_reasoning", "turns": ["What is 3 + 4?", "And times 2?"]},
    ])
    traffic = load_traffic(path)
    assert [r.id for r in traffic.requests] == ["81", "82", "161"]
    assert traffic.categories() == {"math_reasoning": 1, "writing": 2}
    assert traffic.requests[2].messages == ({"role": "user", "content": "What is 3 + 4?"},)


def test_the_shared_spec_bench_file_reads_too():
    traffic = load_traffic(shared_data("spec_bench.jsonl"))
    assert len(traffic.requests) == 360 and not traffic.malformed and not traffic.duplicates
    assert all(len(r.messages) == 1 and r.messages[0]["role"] == "user" for r in traffic.requests)


def test_retries_are_kept_once_and_counted_while_a_reused_id_is_malformed(tmp_path):
    hello = {"request_id": "q1", "body": {"messages": [{"role": "user", "content": "hello"}]}}
    path = write_lines(tmp_path / "t.jsonl", [hello, {"prompt": "same words"}, {**hello, "timestamp": 5},
                                              {"prompt": "same words"}, {"id": "q2", "prompt": "x"}])
    traffic = load_traffic(path)
    assert [(r.id, r.line) for r in traffic.requests][::2] == [("q1", 1), ("q2", 5)]
    assert traffic.requests[0].instant is None and traffic.duplicates == 2
    write_lines(path, [hello, {"id": "q1", "prompt": "another question"}])
    with pytest.raises(TrafficError, match=f"^{path}:2: duplicate id 'q1' with other messages than at {path}:1"):
        load_traffic(path)


def test_rotated_logs_are_read_by_glob_in_name_order_gzip_included(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write_lines(logs / "requests-2.jsonl", [{"id": "c", "prompt": "third"}])
    with gzip.open(logs / "requests-1.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "a", "prompt": "first"}) + "\n" + json.dumps({"id": "b", "prompt": "second"}) + "\n")
    write_lines(logs / "other.jsonl", [{"id": "z", "prompt": "not matched"}])
    traffic = load_traffic(logs / "requests-*")
    assert [r.id for r in traffic.requests] == ["a", "b", "c"]
    assert traffic.files == [logs / "requests-1.jsonl.gz", logs / "requests-2.jsonl"]
    assert traffic.path == logs / "requests-*"
    with gzip.open(logs / "requests-1.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "a", "prompt": "first"}) + "\n{broken\n")
    with pytest.raises(TrafficError, match=f"^{logs / 'requests-1.jsonl.gz'}:2: "):
        load_traffic(logs / "requests-*")
    with pytest.raises(TrafficError, match="no traffic file matches"):
        load_traffic(logs / "nothing-*.jsonl")


TIMED = [  # the same instant range written five ways; file order is not time order
    {"id": "utc-0130", "ts": "2026-10-01T01:30:00Z", "prompt": "p"},
    {"id": "paris-0200", "ts": "2026-10-01T02:00:00+02:00", "prompt": "p"},  # 00:00 UTC
    {"id": "naive-0100", "ts": "2026-10-01T01:00:00", "prompt": "p"},  # read as UTC
    {"id": "epoch-s-0045", "timestamp": 1790815500, "prompt": "p"},  # 00:45 UTC
    {"id": "epoch-ms-0015", "created": 1790813700000, "prompt": "p"},  # 00:15 UTC
    {"id": "untimed", "prompt": "p"},
]


def test_requests_are_ordered_by_the_instant_not_by_how_it_was_written(tmp_path):
    traffic = load_traffic(write_lines(tmp_path / "t.jsonl", TIMED))
    assert [r.id for r in traffic.requests] == [r["id"] for r in TIMED]  # the log order is kept
    assert [r.id for r in chronological(traffic.requests)] == [
        "untimed", "paris-0200", "epoch-ms-0015", "epoch-s-0045", "naive-0100", "utc-0130"]
    assert traffic.requests[1].instant == datetime(2026, 10, 1, 0, 0, tzinfo=timezone.utc)
    assert traffic.requests[3].ts == "1790815500"


def test_a_time_window_keeps_since_inclusive_and_until_exclusive(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", TIMED)
    with pytest.raises(TrafficError, match=f"^{path}:6: no time"):
        load_traffic(path, since="2026-10-01T00:15:00Z")
    traffic = load_traffic(path, skip_malformed=True, since="2026-10-01T00:15:00Z", until=1790816400)  # 01:00
    assert sorted(r.id for r in traffic.requests) == ["epoch-ms-0015", "epoch-s-0045"]
    assert traffic.outside_window == 3 and len(traffic.malformed) == 1
    later = load_traffic(path, skip_malformed=True, since=datetime(2026, 10, 1, 1, 0))
    assert sorted(r.id for r in later.requests) == ["naive-0100", "utc-0130"]
    with pytest.raises(TrafficError, match="no valid requests .5 outside"):  # paris-0200 is at 00:00 UTC
        load_traffic(path, skip_malformed=True, until="2026-10-01T00:00:00+00:00")
    with pytest.raises(TrafficError, match="traffic.since: time 'yesterday'"):
        load_traffic(path, since="yesterday")
