from pathlib import Path

import pytest

from pipeline.config import ConfigError, DraftopsConfig, load_config, reference_markdown, save_config


def test_default_config_is_the_embedded_default():
    cfg = load_config()
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.traffic.path == "default"
    assert cfg.decode.gamma == 5
    # configs/default.yaml spells out the schema defaults, and picks the default job's draft family
    assert cfg == DraftopsConfig(distill={"family": "features"})


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["decode.gamma=3", "traffic.heldout_fraction=0.2", "tracking.uri=sqlite:///x.db",
                             "decode.gamma_policy=adaptive"])
    assert cfg.decode.gamma == 3 and cfg.decode.gamma_policy == "adaptive"
    assert cfg.traffic.heldout_fraction == pytest.approx(0.2)
    assert cfg.tracking.uri == "sqlite:///x.db"


def test_a_bare_no_is_the_option_no_not_false(tmp_path):
    # YAML 1.1 reads `no` as false; mixed_precision's off value is the string "no"
    assert load_config(None, ["distill.mixed_precision=no"]).distill.mixed_precision == "no"
    path = tmp_path / "mp.yaml"
    path.write_text("distill:\n  mixed_precision: no\n")
    assert load_config(path).distill.mixed_precision == "no"
    with pytest.raises(ConfigError, match="distill.mixed_precision"):
        load_config(None, ["distill.mixed_precision=true"])


def test_misspelled_key_in_file_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  gama: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value) and "decode.gama" in str(err.value) and "unknown key" in str(err.value)


def test_wrong_type_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("decode:\n  gamma: many\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: decode\.gamma"):
        load_config(path)


def test_bad_override_names_key_and_command_line():
    with pytest.raises(ConfigError, match=r"command line: unknown key 'decode\.gamme'"):
        load_config(None, ["decode.gamme=3"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["decode.gamma"])
    with pytest.raises(ConfigError, match="decode.gamma"):
        load_config(None, ["decode.gamma=0"])


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(None, ["seed=7", "decode.top_k=20"])
    assert load_config(save_config(cfg, tmp_path / "run" / "config.yaml")) == cfg


def test_reference_lists_every_key_with_its_default():
    from pipeline.config import iter_fields, reference_markdown

    table = reference_markdown()
    keys = [key for key, _ in iter_fields()]
    assert {"decode.gamma", "traffic.heldout_fraction", "distill.loss", "monitor.schedule"} <= set(keys)
    for key in keys:
        assert f"| `{key}` |" in table
    assert "| `decode.gamma` | `5` | Draft tokens proposed per target call. |" in table


def test_docs_config_reference_is_current():
    """docs/configuration.md's table is `draftops config --reference`; regenerate it when the schema changes."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert reference_markdown() in page


def test_a_bare_off_reads_as_the_word_not_as_false():
    """YAML 1.1 reads `off` as false; `monitor.deploy.engine_check=off` means the choice "off"."""
    assert load_config(None, ["monitor.deploy.engine_check=off"]).monitor.deploy.engine_check == "off"


def test_each_family_trains_with_its_measured_best_recipe_unless_set():
    """Unset, a family's keys are its defaults (docs/results.md): forward KL from the target's layers under AdamW for a
    layer draft; for a feature draft speculators' start and optimizer (random layer, frozen head rows, norm before the
    residual, Muon + AdamW linear, at 2e-3) with kl_tv and reach weights, at half the batch for 1.5 epochs; a value
    given is kept. configs/default.yaml distills a feature draft."""
    layers = load_config(None, ["distill.family=layers"]).distill
    features = load_config(None, []).distill
    assert features.family == "features" and DraftopsConfig().distill.family == "layers"
    assert (layers.batch_size, layers.epochs, features.batch_size, features.epochs) == (16, 3, 8, 1.5)
    chosen = load_config(None, ["distill.family=features", "distill.loss=forward_kl", "distill.ttt_weighting=uniform",
                                "distill.init=target_layers", "distill.train_head=true", "distill.optimizer=adamw",
                                "distill.learning_rate=3e-3"]).distill
    assert (layers.loss, layers.ttt_weighting, layers.init, layers.train_head, layers.optimizer,
            layers.learning_rate, layers.lr_schedule) == ("forward_kl", "uniform", "target_layers", True, "adamw",
                                                          3e-3, "cosine")
    assert (features.loss, features.ttt_weighting, features.init, features.train_head, features.norm_before_residual,
            features.optimizer, features.learning_rate, features.lr_schedule, features.min_lr_ratio,
            features.weight_decay) == ("kl_tv", "reach", "config", False, True, "muon", 2e-3, "linear", 0.0, 0.01)
    assert (chosen.loss, chosen.ttt_weighting, chosen.init, chosen.train_head, chosen.optimizer,
            chosen.learning_rate) == ("forward_kl", "uniform", "target_layers", True, "adamw", 3e-3)
    assert chosen.norm_before_residual and chosen.lr_schedule == "linear"  # the keys not given: the family's


def test_the_final_states_teacher_is_a_feature_drafts_alone():
    assert load_config(None, ["distill.family=features", "distill.teacher=final"]).distill.teacher == "final"
    with pytest.raises(ConfigError, match="teacher=final applies to family 'features'"):
        load_config(None, ["distill.family=layers", "distill.teacher=final"])


def test_an_mlp_width_is_refused_at_load_where_the_draft_keeps_the_targets_layers():
    width = "distill.draft_intermediate_size=6144"
    assert load_config(None, ["distill.family=features", width]).distill.draft_intermediate_size == 6144
    checkpoint = load_config(None, ["distill.family=features", "distill.init=checkpoint", width])  # keeps its own
    assert checkpoint.distill.draft_intermediate_size == 6144
    for refused in (["distill.family=layers", width], ["distill.family=features", "distill.init=target_layers", width]):
        with pytest.raises(ConfigError, match="draft_intermediate_size applies to a feature draft from init=config"):
            load_config(None, refused)
