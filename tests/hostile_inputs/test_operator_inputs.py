"""More operator input that is one line and exit 2, never a traceback: a checkpoint folder without a tokenizer, pickle
weights that hold code (refused, never run), a directory or a FIFO given as traffic (said as such, not "not
found"), a version number past what the store can hold; and input that is simply read: a traffic file whose name
holds glob characters, a UTF-8 byte-order mark before the first line."""
from __future__ import annotations

import json
import os
import pickle

import mlflow
import pytest

from pipeline import registry
from pipeline.cli import main
from pipeline.registry import RegistryError
from pipeline.sources import SourceError, resolve_model
from pipeline.traffic import TrafficError, load_traffic

LINE = {"id": "a", "category": "c", "prompt": "hello"}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("draftops: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_checkpoint_folder_without_a_tokenizer_is_one_line(tiny_checkpoint, capsys):
    for name in os.listdir(tiny_checkpoint):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")) or name in ("vocab.json", "merges.txt"):
            os.remove(tiny_checkpoint / name)
    with pytest.raises(SourceError, match="no tokenizer that loads"):
        resolve_model(str(tiny_checkpoint), device="cpu")
    assert main(["decode", "--target", str(tiny_checkpoint), "--draft", "prompt-lookup", "--prompt", "hi",
                 "device=cpu"]) == 2
    assert f"{tiny_checkpoint}: no tokenizer that loads" in one_error_line(capsys)


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_weights_that_hold_code_are_one_line_and_never_run(tiny_checkpoint, tmp_path, capsys):
    marker = tmp_path / "ran"
    (tiny_checkpoint / "model.safetensors").unlink()
    with open(tiny_checkpoint / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _RunsCode(str(marker))}, f)
    assert main(["decode", "--target", str(tiny_checkpoint), "--draft", "prompt-lookup", "--prompt", "hi",
                 "device=cpu"]) == 2
    assert "pytorch_model.bin is a pickle that holds more than tensors; not loaded" in one_error_line(capsys)
    assert not marker.exists()


def test_a_directory_or_a_fifo_given_as_traffic_says_what_it_is(tmp_path, capsys):
    with pytest.raises(TrafficError, match="a directory, not a traffic file"):
        load_traffic(tmp_path)
    fifo = tmp_path / "traffic.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(TrafficError, match="a FIFO, not a traffic file"):
        load_traffic(fifo)  # refused without opening it: a FIFO nobody writes would block the read
    assert main(["traffic", "stats", str(tmp_path)]) == 2
    assert "a directory, not a traffic file" in one_error_line(capsys)


def test_a_file_name_with_glob_characters_is_read_as_named_and_a_bom_is_skipped(tmp_path):
    named = tmp_path / "log[1].jsonl"
    named.write_bytes(b"\xef\xbb\xbf" + json.dumps(LINE).encode() + b"\n")
    traffic = load_traffic(named)
    assert [r.id for r in traffic.requests] == ["a"] and traffic.path == named
    (tmp_path / "log1.jsonl").write_text(json.dumps({**LINE, "id": "b"}) + "\n")
    assert [r.id for r in load_traffic(tmp_path / "log[0-9].jsonl").requests] == ["b"]  # a glob still globs


def test_a_version_past_what_the_store_holds_is_no_such_version(mlflow_uri, tiny_checkpoint, capsys):
    mlflow.set_experiment("versions")
    with mlflow.start_run():
        registry.register(tiny_checkpoint, "drafts", tags={}, description="d")
    huge = "1" * 23
    with pytest.raises(RegistryError, match=f"has no version {huge} \\(versions: 1\\)"):
        registry.rollback("drafts", huge)
    with pytest.raises(RegistryError, match=f"not in the MLflow registry at .*: no version {huge}"):
        registry.find_version(f"models:/drafts/{huge}")
    capsys.readouterr()
    assert main(["monitor", "rollback", "--to-version", huge, "tracking.registered_model=drafts",
                 f"tracking.uri={mlflow_uri}"]) == 2
    assert f"registered model 'drafts' has no version {huge}" in one_error_line(capsys)
