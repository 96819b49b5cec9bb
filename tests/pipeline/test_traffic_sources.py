"""Traffic as teams keep it: ShareGPT (JSONL, a JSON array, gzip), and data sets saved with `datasets` (a saved
folder, parquet, arrow), each with its bad records named, the held-out split by id, and the count per format."""
from __future__ import annotations

import gzip
import json

import pytest

from pipeline.cli import main
from pipeline.traffic import TrafficError, load_traffic, split_of

# ShareGPT's documented shape: a list of {"conversations": [{"from": ..., "value": ...}]}, the speaker in `from`
SHAREGPT = [
    {"id": "s1", "conversations": [{"from": "human", "value": "What is a prime?"},
                                   {"from": "gpt", "value": "A number with exactly two divisors."}]},
    {"id": "s2", "conversations": [{"from": "system", "value": "Be brief."},
                                   {"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "Seven."},
                                   {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Eleven."}]},
    {"id": "s3", "conversations": [{"from": "human", "value": "Weather?"}],
     "tools": json.dumps([{"type": "function", "function": {"name": "weather", "parameters": {}}}])},
]
BAD_SHAREGPT = {"id": "bad", "conversations": [{"from": "alien", "value": "hi"}]}


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sharegpt_jsonl_keeps_turns_reply_and_tools(tmp_path):
    traffic = load_traffic(write_jsonl(tmp_path / "chat.jsonl", SHAREGPT))
    by_id = {r.id: r for r in traffic.requests}
    assert by_id["s1"].messages == ({"role": "user", "content": "What is a prime?"},)
    assert by_id["s1"].reply == {"role": "assistant", "content": "A number with exactly two divisors."}
    assert [m["role"] for m in by_id["s2"].messages] == ["system", "user", "assistant", "user"]
    assert by_id["s2"].reply["content"] == "Eleven."
    assert by_id["s3"].reply is None and by_id["s3"].tools[0]["function"]["name"] == "weather"
    assert traffic.formats == {"sharegpt (jsonl)": 3}


@pytest.mark.parametrize("name, opener", [("chat.json", open), ("chat.json.gz", gzip.open)])
def test_sharegpt_json_array_and_gzip_name_the_bad_row(tmp_path, name, opener):
    path = tmp_path / name
    with opener(path, "wt") as f:
        json.dump(SHAREGPT + [BAD_SHAREGPT], f)
    with pytest.raises(TrafficError) as err:
        load_traffic(path)
    assert str(err.value).startswith(f"{path}: row 3: message 0 needs a 'from' in")
    traffic = load_traffic(path, skip_malformed=True)
    assert len(traffic.requests) == 3 and traffic.formats == {"sharegpt (json)": 3} and len(traffic.malformed) == 1


def test_sharegpt_bad_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl.gz", SHAREGPT[:1] + [BAD_SHAREGPT], opener=gzip.open)
    with pytest.raises(TrafficError, match=r"chat\.jsonl\.gz:2: message 0 needs a 'from'"):
        load_traffic(path)


def _dataset_rows():
    """A data set of OpenAI-style `messages` under its own column names, as chat data sets on the hub keep them."""
    return [{"uuid": f"d{i}", "task": "math", "created_at": 1759280400 + i,
             "conversation": [{"role": "user", "content": f"What is {i} + {i}?"},
                              {"role": "assistant", "content": f"{2 * i}."}]} for i in range(20)]


COLUMNS = {"messages": "conversation", "id": "uuid", "category": "task", "time": "created_at"}


def test_saved_dataset_folder_with_a_column_mapping(tmp_path):
    from datasets import Dataset

    rows = _dataset_rows()
    rows[7]["conversation"] = [{"role": "assistant", "content": "no question"}]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(TrafficError) as err:
        load_traffic(tmp_path / "saved", columns=COLUMNS)
    assert str(err.value).startswith(f"{tmp_path / 'saved'}: row 7: the last message must come from the user")
    traffic = load_traffic(tmp_path / "saved", columns=COLUMNS, skip_malformed=True)
    first = traffic.requests[0]
    assert (first.id, first.category, first.instant.year) == ("d0", "math", 2025)
    assert first.reply == {"role": "assistant", "content": "0."}
    assert traffic.formats == {"messages (dataset)": 19}


def test_parquet_and_arrow_rows_and_errors(tmp_path):
    from datasets import Dataset

    rows = _dataset_rows()
    rows[3]["uuid"] = "d2"  # the same id with other messages than row 2
    dataset = Dataset.from_list(rows)
    dataset.to_parquet(str(tmp_path / "chat.parquet"))
    with pytest.raises(TrafficError) as err:
        load_traffic(tmp_path / "chat.parquet", columns=COLUMNS)
    assert str(err.value).startswith(f"{tmp_path / 'chat.parquet'}: row 3: duplicate id 'd2'")
    dataset.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path, form in ((tmp_path / "chat.parquet", "messages (parquet)"), (arrow, "messages (arrow)")):
        traffic = load_traffic(path, columns=COLUMNS, skip_malformed=True)
        assert traffic.formats == {form: 19} and traffic.malformed[0].startswith(f"{path}: row 3: duplicate id")


def test_the_split_is_by_id_whatever_the_format(tmp_path):
    from datasets import Dataset

    rows = _dataset_rows()
    Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    write_jsonl(tmp_path / "chat.jsonl", [{"id": r["uuid"], "messages": r["conversation"]} for r in rows])
    parquet = load_traffic(tmp_path / "chat.parquet", columns=COLUMNS)
    jsonl = load_traffic(tmp_path / "chat.jsonl")
    for name in ("train", "heldout"):
        assert [r.id for r in parquet.split(name, 0.3)] == [r.id for r in jsonl.split(name, 0.3)]
    assert all(split_of(r.id, 0.3) == "heldout" for r in parquet.split("heldout", 0.3))


def test_a_folder_not_saved_by_datasets_is_one_line(tmp_path):
    (tmp_path / "logs").mkdir()
    with pytest.raises(TrafficError, match="a folder, but not one `datasets` saved"):
        load_traffic(tmp_path / "logs")


def test_gateway_response_is_the_recorded_reply(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    record = {"request_id": "g1", "body": body,
              "response": {"choices": [{"message": {"role": "assistant", "content": "Hello",
                                                    "reasoning_content": "greet back"}}]}}
    request = load_traffic(write_jsonl(tmp_path / "gw.jsonl", [record])).requests[0]
    assert request.reply == {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}


def test_traffic_stats_counts_per_format(tmp_path, capsys, tiny_checkpoint):
    from datasets import Dataset

    Dataset.from_list(_dataset_rows()).to_parquet(str(tmp_path / "a.parquet"))
    write_jsonl(tmp_path / "b.jsonl", SHAREGPT)
    code = main(["traffic", "stats", str(tmp_path / "*"), "--json", "--tokenizer", str(tiny_checkpoint),
                 *[f"--column={k}={v}" for k, v in COLUMNS.items()]])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["formats"] == {"messages (parquet)": 20, "sharegpt (jsonl)": 3}


def _damaged(whole: bytes) -> dict[str, bytes]:
    """A file's bytes as a disk, a copy or a hand can leave them."""
    third = len(whole) // 3
    return {"empty": b"", "garbage": b"not a table at all\n" * 40, "cut": whole[:len(whole) // 2],
            "zeroed": whole[:third] + bytes(third) + whole[2 * third:]}


# an arrow file has no checksums: a third of it zeroed inside its strings is read, as text holding NULs
@pytest.mark.parametrize("suffix, damage", [(".parquet", "empty"), (".parquet", "garbage"), (".parquet", "cut"),
                                           (".parquet", "zeroed"), (".arrow", "empty"), (".arrow", "garbage"),
                                           (".arrow", "cut")])
def test_a_corrupt_parquet_or_arrow_file_is_one_line_naming_it(suffix, damage, tmp_path, capsys, tiny_checkpoint):
    from datasets import Dataset

    rows = [{"uuid": f"d{i}", "conversation": [{"role": "user", "content": f"question {i} " * 40}]}
            for i in range(1000)]
    dataset = Dataset.from_list(rows)
    if suffix == ".parquet":
        dataset.to_parquet(str(tmp_path / "whole.parquet"))
        whole = (tmp_path / "whole.parquet").read_bytes()
    else:
        dataset.save_to_disk(str(tmp_path / "saved"))
        whole = next((tmp_path / "saved").glob("*.arrow")).read_bytes()
    path = tmp_path / f"traffic{suffix}"
    path.write_bytes(_damaged(whole)[damage])
    code = main(["traffic", "stats", str(path), "--tokenizer", str(tiny_checkpoint),
                 *[f"--column={k}={v}" for k, v in COLUMNS.items()]])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # datasets' progress bars
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"draftops: error: {path}"), err[-2000:]
