"""The precisions a distill job computes in (`distill.precision`). `distill.generation_dtype: auto`: gated on bf16
units, decided by the step's products, cached per machine and row count. `distill.mixed_precision: auto`: gated on
bf16 units and the CPU, decided by a timed training step of the draft, cached per machine and step shape; a distill
job records what it trained in. Both are cached even when timed on a busy machine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState

from decode.models.feature_draft import feature_draft_from_target
from decode.runtime import machine_choice
from decode.runtime.machine_choice import cache_file
from distill import precision
from distill.step import FeatureStepLogits, ResponseLogits
from distill.train import run_distill, training_precision
from pipeline.config import load_config
from tests.conftest import make_tiny_model
from tests.distill.tiny_job import tiny_config


def test_auto_times_the_step_once_per_shape_and_picks_the_faster(monkeypatch):
    step_logits = ResponseLogits(make_tiny_model(64, seed=0))
    timed = []

    def fake_time(module, vocab, *, rows, length):
        timed.append((rows, length))
        return 2.0, 1.0

    monkeypatch.setattr(precision, "time_steps", fake_time)
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: "load 6.1 on 2 CPUs")  # cached all the same
    monkeypatch.setattr(precision, "bf16_units", lambda: ["avx512_bf16"])
    cpu = torch.device("cpu")
    with pytest.warns(machine_choice.BusyMachineWarning, match="all the same"):
        assert precision.mixed_precision_choice("auto", step_logits, 64, device=cpu, rows=4,
                                                mean_length=70) == "bf16"
    assert timed == [(4, 128)]  # the mean length rounded up to LENGTH_STEP
    path = cache_file(precision.TRAINING, precision.step_scope(step_logits.draft, 4, 128))
    assert json.loads(path.read_text())["items"]["value"] == [2.0, 1.0]
    monkeypatch.setattr(machine_choice, "UNSAVED", {})  # as a rerun of a killed job: read back
    assert precision.mixed_precision_choice("auto", step_logits, 64, device=cpu, rows=4, mean_length=100) == "bf16"
    assert len(timed) == 1  # read back from the cache, not timed again
    monkeypatch.setattr(precision, "time_steps", lambda *a, **k: (1.0, 2.0))
    with pytest.warns(machine_choice.BusyMachineWarning):
        assert precision.mixed_precision_choice("auto", step_logits, 64, device=cpu, rows=8, mean_length=70) == "no"


def test_auto_is_full_precision_without_bf16_units_or_off_the_cpu_and_an_explicit_setting_is_kept(monkeypatch):
    step_logits = ResponseLogits(make_tiny_model(64, seed=0))
    monkeypatch.setattr(precision, "time_steps", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    monkeypatch.setattr(precision, "bf16_units", lambda: [])
    choose = precision.mixed_precision_choice
    assert choose("auto", step_logits, 64, device=torch.device("cpu"), rows=4, mean_length=70) == "no"
    monkeypatch.setattr(precision, "bf16_units", lambda: ["amx_bf16"])
    assert choose("auto", step_logits, 64, device=torch.device("meta"), rows=4, mean_length=70) == "no"
    assert choose("bf16", step_logits, 64, device=torch.device("cpu"), rows=4, mean_length=70) == "bf16"


def test_a_real_timing_leaves_no_gradients_and_the_random_state_alone():
    step_logits = ResponseLogits(make_tiny_model(64, seed=0))
    state = torch.random.get_rng_state()
    fp32_s, bf16_s = precision.time_steps(step_logits, 64, rows=2, length=16)
    assert fp32_s > 0 and bf16_s > 0
    assert all(p.grad is None for p in step_logits.parameters())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_feature_drafts_step_is_timed_on_random_features_and_leaves_no_gradients():
    target = make_tiny_model(64, seed=0)
    step_logits = FeatureStepLogits(feature_draft_from_target(target), steps=2)
    fp32_s, bf16_s = precision.time_steps(step_logits, 64, rows=2, length=16)
    assert fp32_s > 0 and bf16_s > 0
    assert all(p.grad is None for p in step_logits.parameters())


def test_auto_times_the_step_of_the_drafts_own_family(isolated_home, monkeypatch):
    """A feature draft's precision is timed on its own training-time-test step, as a layer draft's is on its."""
    monkeypatch.setattr(precision, "bf16_units", lambda: ["avx512_bf16"])
    timed = []
    monkeypatch.setattr(precision, "time_steps",
                        lambda module, *a, **k: timed.append(type(module).__name__) or (2.0, 1.0))
    target = make_tiny_model(64, seed=0)
    data = SimpleNamespace(train=SimpleNamespace(prompt_ids=[[1, 2]], response_ids=[[3, 4, 5]]))
    for family, draft in (("layers", make_tiny_model(64, seed=1)), ("features", feature_draft_from_target(target))):
        cfg = load_config(None, [f"distill.family={family}"])
        assert training_precision(cfg, PartialState(), draft, data) == "bf16"
    assert timed == ["ResponseLogits", "FeatureStepLogits"]


def test_a_job_on_auto_says_and_records_what_it_trained_in(isolated_home, monkeypatch, capsys):
    monkeypatch.setattr(precision, "bf16_units", lambda: ["avx512_bf16"])
    monkeypatch.setattr(precision, "time_steps", lambda *a, **k: (2.0, 1.0))
    result = run_distill(tiny_config(isolated_home, "distill.max_steps=2", "distill.register_model=false"))
    assert result.mixed_precision == "bf16"
    assert "bf16 mixed precision (auto: timed on this CPU)" in capsys.readouterr().out
    saved = json.loads((result.job_dir / "result.json").read_text())
    assert saved["mixed_precision"] == "bf16"


def test_under_bf16_autocast_the_attention_runs_in_fp32_for_the_duration_only(monkeypatch):
    from transformers import AttentionInterface

    model = make_tiny_model(64, seed=0)
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        out = precision._sdpa_in_fp32(module, query, key, value, attention_mask, **kwargs)
        seen.append((query.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return out

    AttentionInterface.register(precision.FP32_ATTENTION, spy)
    try:
        ids = torch.randint(0, 64, (2, 7))
        with precision.fp32_attention(model), torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids).logits.float().sum().backward()
        assert len(seen) == model.config.num_hidden_layers and {s[2] for s in seen} == {True}
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        assert model.config._attn_implementation == "sdpa"  # restored
        with precision.fp32_attention(model, on=False):
            assert model.config._attn_implementation == "sdpa"
    finally:
        AttentionInterface.register(precision.FP32_ATTENTION, precision._sdpa_in_fp32)


def test_generation_step_cost_weighs_each_shape_by_its_layers_and_is_cached(monkeypatch):
    model = make_tiny_model(64, seed=0)
    measured = []

    def fake_measure(shape, rows):
        measured.append((shape, rows))
        return (1.0, 0.5) if shape[0] == 64 else (1.0, 3.0)  # bf16 wins only on the head's shape

    monkeypatch.setattr(precision, "measure_shape", fake_measure)
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)
    counts = precision.linear_shapes(model)
    fp32_ms, bf16_ms = precision.step_costs(model, 16)
    assert fp32_ms == sum(counts.values())
    assert bf16_ms == sum(n * (0.5 if s[0] == 64 else 3.0) for s, n in counts.items())
    assert {rows for _, rows in measured} == {16} and len(measured) == len(counts)
    assert cache_file(precision.GENERATION, {"rows": 16}).exists()
    measured.clear()
    assert precision.step_costs(model, 16) == (fp32_ms, bf16_ms) and not measured  # read back, not measured
    precision.step_costs(model, 32)
    assert {rows for _, rows in measured} == {32}  # another batch is another file
    monkeypatch.setattr(precision, "bf16_units", lambda: ["avx512_bf16"])
    assert precision.generation_dtype(model, 16) == torch.float32  # the layers' sum favours fp32 here
    monkeypatch.setattr(precision, "step_costs", lambda model, rows: (2.0, 1.0))
    assert precision.generation_dtype(model, 16) == torch.bfloat16
    assert precision.generation_dtype(model.to(torch.bfloat16), 16) == torch.bfloat16  # its own dtype


def test_generation_precision_timed_on_a_busy_machine_is_cached_all_the_same(monkeypatch):
    """It decides the training responses: a killed job's rerun must generate in the precision the first run chose."""
    model = make_tiny_model(64, seed=0)
    monkeypatch.setattr(precision, "measure_shape", lambda shape, rows: (1.0, 2.0))
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: "load 6.1 on 2 CPUs")
    with pytest.warns(machine_choice.BusyMachineWarning, match="all the same"):
        first = precision.step_costs(model, 16)
    monkeypatch.setattr(machine_choice, "UNSAVED", {})  # another process
    monkeypatch.setattr(precision, "measure_shape", lambda shape, rows: pytest.fail("timed again"))
    assert precision.step_costs(model, 16) == first


def test_a_real_generation_measurement_returns_both_times():
    fp32_ms, bf16_ms = precision.measure_shape((32, 16), 4)
    assert fp32_ms > 0 and bf16_ms > 0


def test_a_resumed_job_trains_on_in_the_precision_its_checkpoint_recorded(isolated_home, monkeypatch):
    """auto is timed per process and cached per thread count: a job killed and resumed under other conditions may
    time the other way, and would change precision halfway through its schedule."""
    import distill.train as train_job

    monkeypatch.setattr(train_job, "mixed_precision_choice", lambda *a, **k: "bf16")
    cfg = tiny_config(isolated_home, "distill.max_steps=4", "distill.checkpoint_every=2",
                      "distill.register_model=false")
    first = run_distill(cfg)
    assert first.mixed_precision == "bf16"
    (first.job_dir / "result.json").unlink()  # as if killed after its checkpoint of step 2
    monkeypatch.setattr(train_job, "mixed_precision_choice", lambda *a, **k: "no")
    resumed = run_distill(cfg)
    assert resumed.mixed_precision == "bf16" and len(resumed.history) == 4
    (first.job_dir / "result.json").unlink()
    assert run_distill(cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"resume": False})})
                       ).mixed_precision == "no"  # no checkpoint read: timed afresh
