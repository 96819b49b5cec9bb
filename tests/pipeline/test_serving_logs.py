import json
from datetime import datetime, timedelta, timezone

import pytest

from pipeline.serving_logs import parse_instant
from pipeline.traffic import TrafficError, load_traffic


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


USER = {"role": "user", "content": "What is the weather in Paris?"}
BODY = {"model": "gpt-4o-mini", "temperature": 0.2, "stream": True, "messages": [USER]}


def test_bare_bodies_and_each_envelope_read_alike(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        BODY,
        {"request_id": "r2", "timestamp": "2026-10-01T00:00:00Z", "body": BODY},
        {"id": "r3", "created": 1790812800, "category": "chat", "request": json.dumps(BODY)},
        {"id": "r4", "ts": 1790812800000, "body": {**BODY, "category": "travel"}},
    ])
    requests = load_traffic(path).requests
    assert [r.messages for r in requests] == [(USER,)] * 4
    assert requests[0].id.startswith("sha-") and requests[0].ts is None
    assert [r.id for r in requests[1:]] == ["r2", "r3", "r4"]
    assert [r.category for r in requests] == ["uncategorized", "uncategorized", "chat", "travel"]
    midnight = datetime(2026, 10, 1, tzinfo=timezone.utc)
    assert [r.instant for r in requests[1:]] == [midnight] * 3


def test_text_parts_are_joined_and_other_parts_skipped(tmp_path):
    parts = [{"type": "text", "text": "Describe this picture."},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
             {"type": "text", "text": "Be brief."}]
    path = write_lines(tmp_path / "t.jsonl", [{"id": "p", "messages": [{"role": "user", "content": parts}]}])
    assert load_traffic(path).requests[0].messages == (
        {"role": "user", "content": "Describe this picture.\nBe brief."},)


def test_roles_developer_is_system_and_tool_turns_stay_in_the_conversation(tmp_path):
    call = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]
    result = {"role": "tool", "tool_call_id": "call_1", "name": "weather", "content": [{"type": "text", "text": "18C"}]}
    messages = [{"role": "developer", "content": "Answer in French."}, USER,
                {"role": "assistant", "content": None, "tool_calls": call}, result]
    follow_up = messages + [{"role": "user", "content": "And?"}]
    path = write_lines(tmp_path / "t.jsonl", [{"id": "t", "body": {"model": "m", "messages": messages}},
                                              {"id": "u", "messages": follow_up}])
    tool_request, user_request = load_traffic(path).requests
    assert tool_request.messages == (
        {"role": "system", "content": "Answer in French."}, USER,
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "weather"})
    assert user_request.messages[-1] == {"role": "user", "content": "And?"} and len(user_request.messages) == 5


@pytest.mark.parametrize("bad, reason", [
    ({"request_id": "x", "body": "{not json"}, "'body' is a string but not JSON"),
    ({"request_id": "x", "payload": BODY}, "(or a body or request holding one)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "message 0 has no text content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "every content part needs a 'type'"),
    ({"messages": [{"role": "user", "content": 7}]}, "content must be a string or a list of parts"),
    ({"messages": [USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "the last message must come from"),
    ({"messages": [{"role": "function", "content": "x"}]}, "message 0 needs a role in"),
    ({"id": True, "prompt": "x"}, "'id' must be a string or an integer"),
    ({"ts": "last tuesday", "prompt": "x"}, "'ts': time 'last tuesday' is neither ISO-8601"),
    ({"created": True, "prompt": "x"}, "'created': time True must be"),
])
def test_a_bad_serving_log_line_names_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path / "t.jsonl", [BODY, bad])
    with pytest.raises(TrafficError) as err:
        load_traffic(path)
    assert str(err.value).startswith(f"{path}:2: ") and reason in str(err.value)


@pytest.mark.parametrize("value, expected", [
    ("2026-10-01T02:00:00+02:00", datetime(2026, 10, 1, 0, 0)),
    ("2026-10-01T01:30:00Z", datetime(2026, 10, 1, 1, 30)),
    ("2026-10-01 01:30:00.250", datetime(2026, 10, 1, 1, 30, 0, 250_000)),  # naive: UTC
    (1790812800, datetime(2026, 10, 1)),
    (1790812800.5, datetime(2026, 10, 1, 0, 0, 0, 500_000)),
    (1790812800500, datetime(2026, 10, 1, 0, 0, 0, 500_000)),  # over 1e11: milliseconds
    (datetime(2026, 10, 1, 2, tzinfo=timezone(timedelta(hours=2))), datetime(2026, 10, 1)),
])
def test_times_become_utc_instants(value, expected):
    assert parse_instant(value) == expected.replace(tzinfo=timezone.utc)


def test_offsets_order_by_the_instant_not_the_text():
    assert parse_instant("2026-10-01T02:00:00+02:00") < parse_instant("2026-10-01T01:30:00Z")
    with pytest.raises(ValueError, match="not a finite number"):
        parse_instant(float("nan"))
