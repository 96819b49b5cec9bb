import json

import pytest

from pipeline.cli import main


def test_models_info_json(tiny_checkpoint, capsys):
    assert main(["models", "info", str(tiny_checkpoint), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["layers"], info["hidden_size"], info["vocab_size"]) == (2, 64, 50)
    # embeddings (tied head) + per layer: q,o 64x64, k,v 64x32, mlp 3x64x128, two norms; final norm
    assert info["parameters"] == 50 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert len(info["fingerprint"]) == 16 and info["path"] == str(tiny_checkpoint.resolve())


def test_traffic_stats_reports_counts_and_malformed_lines(tmp_path, tiny_checkpoint, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "1", "category": "qa", "prompt": "what is the answer"}\n{broken\n'
                    '{"id": "2", "category": "code", "prompt": "write code"}\n')
    assert main(["traffic", "stats", str(path), "--tokenizer", str(tiny_checkpoint)]) == 2
    assert f"{path}:2:" in capsys.readouterr().err
    assert main(["traffic", "stats", str(path), "--tokenizer", str(tiny_checkpoint), "--skip-malformed",
                 "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"] == 2 and stats["malformed"] == 1 and stats["categories"] == {"code": 1, "qa": 1}
    assert stats["train"] + stats["heldout"] == 2 and stats["prompt_tokens"]["p100"] == 9


def test_unknown_source_is_a_clean_error(capsys):
    assert main(["models", "info", "/nonexistent/model.gguf"]) == 2
    assert "GGUF file not found" in capsys.readouterr().err


def test_overrides_may_follow_options_that_follow_another_positional(tiny_checkpoint, capsys):
    # argparse closes the key=value list at the first option; the words after it still count as overrides
    assert main(["config", "seed=1", "--config", "configs/default.yaml", "decode.gamma=7"]) == 0
    shown = capsys.readouterr().out
    assert "seed: 1\n" in shown and "gamma: 7\n" in shown
    for argv in (["config", "seed=1", "--reference", "stray"], ["models", "info", str(tiny_checkpoint), "seed=1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
