"""The measurements behind `cpu_linear: auto`: timing in turns, and the per-machine cache."""
from __future__ import annotations

import json
import os

import pytest
import torch

from decode.runtime import kernel_choice
from decode.runtime.kernel_choice import (
    ROWS,
    Timing,
    cache_file,
    machine_key,
    read_cache,
    shape_timings,
)
from decode.runtime.timing import interleaved_minimums


class FakeClock:
    """Time that passes only when a fake kernel runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def kernel(self, durations: list[float]):
        durations = iter(durations)

        def run():
            self.now += next(durations)
        return run


def test_fastest_of_interleaved_turns_after_an_untimed_one():
    clock = FakeClock()
    # the first duration of each is the untimed warm-up turn
    a = clock.kernel([9.0, 0.001, 0.005, 0.002, 0.004, 0.003])
    b = clock.kernel([9.0, 0.010, 0.050, 0.020, 0.040, 0.030])
    assert interleaved_minimums([a, b], reps=5, min_reps=2, budget_s=10.0, clock=clock) == pytest.approx(
        [0.001, 0.010])


def test_the_budget_ends_the_turns_but_not_before_min_reps():
    clock = FakeClock()
    calls = []

    def slow():
        calls.append(clock.now)
        clock.now += 1.0

    # 1 s a call against a budget of 0.5 s: 1 warm-up turn and the minimum of 3 timed turns, not 20
    assert interleaved_minimums([slow], reps=20, min_reps=3, budget_s=0.5, clock=clock) == [1.0]
    assert len(calls) == 4


def test_the_faster_kernel_is_picked_and_a_tie_keeps_torch():
    assert Timing(1, torch_ms=0.2, onednn_ms=0.3).pick == "torch"
    assert Timing(2, torch_ms=0.5, onednn_ms=0.3).pick == "onednn"
    assert Timing(6, torch_ms=0.3, onednn_ms=0.3).pick == "torch"


def fake_timings(shape) -> list[Timing]:
    """Hand-made: torch faster at 1 and 2 rows, oneDNN from 4 rows on; the figures name the shape."""
    out_features, in_features = shape
    return [Timing(r, torch_ms=out_features / 1000 * r, onednn_ms=in_features / 1000 * (3 if r < 4 else 0.5))
            for r in ROWS]


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Whatever else runs beside the tests, the cache is written as on a quiet machine (one test says otherwise)."""
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: None)


class CountingMeasure:
    def __init__(self):
        self.measured: list[tuple[int, int]] = []

    def __call__(self, shape):
        self.measured.append(shape)
        return fake_timings(shape)


def test_the_first_load_measures_later_ones_read_the_cache_keyed_by_machine(isolated_home):
    measure = CountingMeasure()
    first = shape_timings([(64, 64), (128, 64)], measure)
    assert measure.measured == [(64, 64), (128, 64)]
    assert first[(128, 64)] == fake_timings((128, 64))

    key = machine_key()
    path = cache_file(key)
    assert path.parent == isolated_home / "draftops_home" / "cpu_linear"
    assert key == {"cpu": key["cpu"], "torch": torch.__version__, "threads": 1}  # tests run on one thread
    assert path.name.endswith(f"_torch-{torch.__version__}_1-threads.json")
    data = json.loads(path.read_text())
    assert data["key"] == key and sorted(data["shapes"]) == ["128x64", "64x64"]
    assert data["shapes"]["64x64"][0] == {"rows": 1, "torch_ms": 0.064, "onednn_ms": 0.192}

    # a later load reads them; a draft's new shape is measured and added beside the target's
    again = shape_timings([(128, 64), (64, 64), (32, 64)], measure)
    assert measure.measured == [(64, 64), (128, 64), (32, 64)]
    assert again[(64, 64)] == first[(64, 64)]
    assert set(read_cache(path, key)) == {(64, 64), (128, 64), (32, 64)}

    # another thread count is another machine key and file: measured again
    torch.set_num_threads(2)  # the autouse one_thread fixture restores the count
    shape_timings([(64, 64)], measure)
    assert measure.measured[-1] == (64, 64) and len(measure.measured) == 4
    assert cache_file(machine_key()) != path and cache_file(machine_key()).exists()


@pytest.mark.parametrize("content", ["{not json", '{"key": "other", "shapes": {}}', '["a list"]',
                                     '{"key": KEY, "shapes": {"64x64": [{"rows": 1, "torch_ms": 1, "onednn_ms": 2}]}}'])
def test_an_unusable_cache_file_is_measured_again_and_rewritten(isolated_home, content):
    key = machine_key()
    path = cache_file(key)
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", json.dumps(key)))  # the last: measured at other rows than ROWS
    measure = CountingMeasure()
    assert shape_timings([(64, 64)], measure) == {(64, 64): fake_timings((64, 64))}
    assert measure.measured == [(64, 64)]
    assert read_cache(path, key) == {(64, 64): fake_timings((64, 64))}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_timings_from_a_busy_machine_are_used_but_not_cached(isolated_home, monkeypatch):
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: "load 6.1 on 2 CPUs")
    measure = CountingMeasure()
    with pytest.warns(kernel_choice.BusyMachineWarning, match=r"busy machine \(load 6.1 on 2 CPUs\)"):
        assert shape_timings([(64, 64)], measure) == {(64, 64): fake_timings((64, 64))}
    assert not cache_file(machine_key()).exists()
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: None)
    shape_timings([(64, 64)], measure)  # measured again when the machine is quiet, and kept
    assert measure.measured == [(64, 64), (64, 64)] and cache_file(machine_key()).exists()


def test_other_processes_holding_half_the_cpus_is_busy(monkeypatch):
    monkeypatch.undo()  # the real machine_busy
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernel_choice, "runnable_elsewhere", lambda: 1)
    assert kernel_choice.machine_busy() == "1 other runnable thread on 2 CPUs"
    monkeypatch.setattr(kernel_choice, "runnable_elsewhere", lambda: 0)
    assert kernel_choice.machine_busy() is None


def test_without_proc_more_load_than_cpus_is_busy(monkeypatch):
    monkeypatch.undo()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(kernel_choice, "runnable_elsewhere", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.1, 5.0, 4.0))
    assert kernel_choice.machine_busy() == "load 6.1 on 2 CPUs"
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 5.0, 4.0))
    assert kernel_choice.machine_busy() is None


def test_this_process_busy_with_its_own_threads_is_not_other_load():
    """The job's own work (here two threads in torch products, outside the GIL) is not counted against it, as the load
    average would count it."""
    import threading
    before = kernel_choice.runnable_elsewhere()
    if before is None:
        pytest.skip("no /proc")
    stop = threading.Event()
    a = torch.randn(256, 256)

    def spin():
        while not stop.is_set():
            a @ a

    spinners = [threading.Thread(target=spin) for _ in range(2)]
    for spinner in spinners:
        spinner.start()
    try:
        seen = kernel_choice.runnable_elsewhere()
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
    assert seen <= max(before, 1)  # other processes of the machine may hold a core meanwhile
