"""The measured choice of the generation dtype (`decode.runtime.precision_choice`): gated on bf16 units, decided by
the step's products, cached per CPU and row count."""
from __future__ import annotations

import torch

from decode.runtime import kernel_choice, precision_choice
from tests.conftest import make_tiny_model


def test_bf16_units_are_either_instruction_set(monkeypatch):
    monkeypatch.setattr(precision_choice, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert precision_choice.bf16_units() == ["avx512_bf16"]
    monkeypatch.setattr(precision_choice, "cpu_flags", lambda: {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(precision_choice, "amx_bf16_usable", lambda: True)
    assert precision_choice.bf16_units() == ["amx_bf16"]
    monkeypatch.setattr(precision_choice, "amx_bf16_usable", lambda: False)  # a VM that traps AMX
    assert precision_choice.bf16_units() == []
    monkeypatch.setattr(precision_choice, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert precision_choice.bf16_units() == []


def test_the_step_cost_weighs_each_shape_by_its_layers_and_is_cached(monkeypatch):
    model = make_tiny_model(64, seed=0)
    measured = []

    def fake_measure(shape, rows):
        measured.append((shape, rows))
        return (1.0, 0.5) if shape[0] == 64 else (1.0, 3.0)  # bf16 wins only on the head's shape

    monkeypatch.setattr(precision_choice, "measure_shape", fake_measure)
    monkeypatch.setattr(precision_choice, "machine_busy", lambda: None)
    counts = precision_choice.linear_shapes(model)
    fp32_ms, bf16_ms = precision_choice.step_costs(model, 16)
    assert fp32_ms == sum(counts.values())
    assert bf16_ms == sum(n * (0.5 if s[0] == 64 else 3.0) for s, n in counts.items())
    assert {rows for _, rows in measured} == {16} and len(measured) == len(counts)
    path = precision_choice.cache_file(kernel_choice.machine_key(), 16)
    assert path.exists() and path.parent.name == "generation_dtype"
    measured.clear()
    assert precision_choice.step_costs(model, 16) == (fp32_ms, bf16_ms) and not measured  # read back, not measured
    precision_choice.step_costs(model, 32)
    assert {rows for _, rows in measured} == {32}  # another batch is another file
    monkeypatch.setattr(precision_choice, "bf16_units", lambda: ["avx512_bf16"])
    assert precision_choice.generation_dtype(model, 16) == torch.float32  # the layers' sum favours fp32 here
    monkeypatch.setattr(precision_choice, "step_costs", lambda model, rows: (2.0, 1.0))
    assert precision_choice.generation_dtype(model, 16) == torch.bfloat16
    assert precision_choice.generation_dtype(model.to(torch.bfloat16), 16) == torch.bfloat16  # its own dtype


def test_a_real_measurement_returns_both_times():
    fp32_ms, bf16_ms = precision_choice.measure_shape((32, 16), 4)
    assert fp32_ms > 0 and bf16_ms > 0
