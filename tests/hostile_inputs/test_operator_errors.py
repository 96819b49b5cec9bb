"""Bad input from an operator is one line and exit 2, never a traceback: a binary config, a schedule or time zone the
service could not run, a YAML alias bomb, a file named .gguf that is not one, a mistyped path, CLI options outside the
schema; and what only saves time (the fingerprint cache) never fails a command."""
import argparse
import logging
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import sources
from pipeline.cli import main
from pipeline.config import ConfigError, DraftopsConfig, load_config
from pipeline.locks import LOCKS_DIR, lock_path
from pipeline.sources import SourceError, locate


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("draftops: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_binary_config_file_is_one_line(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_bytes(b"monitor:\n  schedule: \xff\xfe\x00\x01")
    assert main(["config", "--config", str(config)]) == 2
    assert f"{config}: not a text file (byte " in one_error_line(capsys)
    assert main(["config", "--config", str(tmp_path)]) == 2  # a folder
    assert "cannot be read" in one_error_line(capsys)


def billion_laughs(levels: int = 9) -> str:
    """A few hundred bytes of YAML whose aliases would expand ten times a level: 10**9 strings at 9 levels."""
    lines = ['    l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"    l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["distill.init_config", "the top level"])
def test_a_yaml_alias_bomb_is_refused_in_one_line_before_it_expands(where, tmp_path, capsys):
    config = tmp_path / "bomb.yaml"
    bomb = billion_laughs()
    config.write_text("distill:\n  init_config:\n" + bomb if where == "distill.init_config" else
                      "bomb:\n" + bomb)
    assert len(config.read_bytes()) < 1000
    started = time.monotonic()
    assert main(["config", "--config", str(config)]) == 2
    assert time.monotonic() - started < 5.0  # refused, not expanded (10**9 strings would take the memory first)
    line = one_error_line(capsys)
    first = 4 if where == "distill.init_config" else 3  # the line of the first alias
    assert f"{config}: line {first}: YAML aliases (*l0) are not accepted in a config" in line, line
    with pytest.raises(ConfigError, match=r"YAML aliases \(\*l0\) are not accepted"):
        load_config(config)


def test_an_alias_bomb_in_an_override_is_refused_in_one_line(capsys):
    inline = "{l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol], " + ", ".join(
        f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, 9)) + "}"
    assert main(["config", f"distill.init_config={inline}"]) == 2
    assert "distill.init_config: not a YAML value: line 1: YAML aliases (*l0) are not accepted" in (
        one_error_line(capsys))


@pytest.mark.parametrize("override, reason", [
    ("monitor.schedule=not a cron", "monitor.schedule: Value error, 'not a cron' is not a crontab expression"),
    ("monitor.schedule=0 25 * * *", "monitor.schedule: Value error, '0 25 * * *' is not a crontab expression"),
    ("monitor.schedule=0 0 30 2 *", "monitor.schedule: Value error, '0 0 30 2 *' never fires in the next 5 years"),
    ("monitor.timezone=Mars/Olympus", "monitor.timezone: Value error, unknown time zone 'Mars/Olympus'"),
    ("monitor.timezone=../../etc/passwd", "unknown time zone"),
    ("decode.temperature=.inf", "decode.temperature: Input should be a finite number"),
    ("tracking.registered_model=../../x", "'../../x' is not a usable registered model name"),
    ("decode.temperature=[", "decode.temperature: not a YAML value"),
])
def test_settings_the_service_could_not_use_are_refused_when_the_config_is_loaded(capsys, override, reason):
    assert main(["config", override]) == 2
    assert reason in one_error_line(capsys)


def test_a_crontab_expression_is_an_override_without_yaml_quoting(capsys):
    assert main(["config", "monitor.schedule=*/5 * * * *"]) == 0
    assert "schedule: '*/5 * * * *'" in capsys.readouterr().out
    # `monitor serve` takes overrides: the schedule parses, and the bad time zone beside it is what is refused
    assert main(["monitor", "serve", "monitor.schedule=*/5 * * * *", "monitor.timezone=Mars/Olympus"]) == 2
    assert "unknown time zone 'Mars/Olympus'" in one_error_line(capsys)
    assert main(["config", "decode.temperature=*"]) == 2  # an alias-looking value is text, then the schema's
    assert "decode.temperature: Input should be a valid number" in one_error_line(capsys)


def test_monitor_serve_with_a_bad_time_zone_is_one_line_before_it_starts(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text("monitor:\n  timezone: Mars/Olympus\n")
    assert main(["monitor", "serve", "--config", str(config)]) == 2
    assert "unknown time zone 'Mars/Olympus'" in one_error_line(capsys)


@pytest.mark.parametrize("flag, value, reason", [
    ("temperature", -1.0, "decode.temperature: Input should be greater than or equal to 0"),
    ("temperature", float("inf"), "decode.temperature: Input should be a finite number"),
    ("top_p", 2.0, "decode.top_p: Input should be less than or equal to 1"),
    ("top_k", -5, "decode.top_k: Input should be greater than or equal to 0"),
    ("max_new_tokens", 0, "decode.max_new_tokens: Input should be greater than or equal to 1"),
])
def test_decode_options_go_through_the_config_schema(flag, value, reason):
    from decode.commands import decode_settings as _decode_settings

    args = argparse.Namespace(**{**dict.fromkeys(("max_new_tokens", "temperature", "top_k", "top_p")), flag: value})
    with pytest.raises(ConfigError, match=reason):
        _decode_settings(load_config(None), args)
    fine = argparse.Namespace(max_new_tokens=None, temperature=0.7, top_k=40, top_p=0.9)
    assert _decode_settings(load_config(None), fine).temperature == 0.7


def test_a_file_named_gguf_that_is_not_one_is_one_line(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model")
    assert main(["models", "info", str(fake)]) == 2
    assert f"{fake}: not a GGUF file (it starts with b'this', not b'GGUF')" in one_error_line(capsys)


def test_a_mistyped_local_path_is_an_error_naming_it_not_a_hub_download(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail("a path that looks local went to the hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "target-updated").mkdir(parents=True)
    for mistyped in ("outputs/target-updatd", "./target", "../x/y", "~/nowhere/model", "a/b/c"):
        with pytest.raises(SourceError, match=f"^{mistyped}: no such file or directory"):
            locate(mistyped)


def test_a_read_only_fingerprint_cache_only_costs_time(tiny_checkpoint, monkeypatch, caplog):
    expected = sources.fingerprint_dir(tiny_checkpoint)
    (sources.draftops_home() / "fingerprints.json").unlink()

    def read_only(path, text):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(sources, "write_text_atomic", read_only)
    with caplog.at_level(logging.WARNING):
        assert sources.fingerprint_dir(tiny_checkpoint) == expected
    assert "fingerprint cache" in caplog.text and "Permission denied" in caplog.text


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "with space", "é"])
def test_a_lock_never_lies_outside_the_lock_folder(tmp_path, name):
    path = lock_path(name, f"sqlite:///{tmp_path}/mlflow.db")
    assert path.parent == tmp_path / LOCKS_DIR and path.name.endswith(".lock") and "/" not in path.name
    assert lock_path(name, f"sqlite:///{tmp_path}/mlflow.db") == path
    assert lock_path("draftops-draft", f"sqlite:///{tmp_path}/mlflow.db").name == "draftops-draft.lock"


# --------------------------------------------------------------------------- fuzzing the config loader

_KEYS = ["target", "device", "seed", "traffic", "traffic.path", "traffic.max_prompt_tokens", "decode",
         "decode.temperature", "decode.top_p", "decode.gamma", "decode.tree_budget_schedule", "monitor",
         "monitor.schedule", "monitor.timezone", "monitor.level", "tracking.registered_model", "distill.loss",
         "nonsense", "decode.nonsense", ""]
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _nested(pairs):
    tree = {}
    for key, value in pairs:
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[leaf] = value
    return tree


_files = st.one_of(
    st.lists(st.tuples(st.sampled_from(_KEYS), _values), max_size=5).map(_nested).map(
        lambda tree: __import__("yaml").safe_dump(tree).encode()),
    st.binary(max_size=64),
    st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 3000).map(lambda depth: b"a: " + b"[" * depth + b"]" * depth),
)
_overrides = st.lists(st.one_of(
    st.tuples(st.sampled_from(_KEYS), st.text(max_size=10)).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=15)), max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=_files, overrides=_overrides)
def test_fuzz_the_config_loader_returns_a_config_or_a_config_error(tmp_path, content, overrides):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(content)
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        assert str(exc).strip()
    else:
        assert isinstance(cfg, DraftopsConfig)
