"""Choices timed on this machine (`decode.runtime.machine_choice`): timing in turns, the cache per machine, choice
and scope, and the busy-machine rule."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from decode.runtime import machine_choice
from decode.runtime.machine_choice import BusyMachineWarning, cache_file, interleaved_minimums, machine_key, measured


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


class CountingMeasure:
    """A measurement whose value names the item, counting what it measured."""

    def __init__(self):
        self.measured: list[str] = []

    def __call__(self, item: str) -> list:
        self.measured.append(item)
        return [item, len(item)]


@pytest.fixture
def quiet(monkeypatch):
    """Whatever else runs beside the tests, the machine reads as quiet."""
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)


def test_items_are_measured_once_per_machine_choice_and_scope(isolated_home, quiet):
    measure = CountingMeasure()
    assert measured("demo", {"rows": (1, 2)}, ["ab", "c"], measure) == {"ab": ["ab", 2], "c": ["c", 1]}
    assert measure.measured == ["ab", "c"]
    path = cache_file("demo", {"rows": (1, 2)})
    assert path.parent == isolated_home / "draftops_home" / "machine_choice" / "demo"
    assert machine_key() == {"cpu": machine_key()["cpu"], "torch": torch.__version__, "threads": 1}  # one thread
    assert f"_torch-{torch.__version__}_1-threads_" in path.name
    assert json.loads(path.read_text()) == {"machine": machine_key(), "scope": {"rows": [1, 2]},
                                            "items": {"ab": ["ab", 2], "c": ["c", 1]}}

    # a later call reads them and measures only what the file lacks, adding it
    assert measured("demo", {"rows": (1, 2)}, ["c", "def"], measure) == {"c": ["c", 1], "def": ["def", 3]}
    assert measure.measured == ["ab", "c", "def"]
    assert sorted(json.loads(path.read_text())["items"]) == ["ab", "c", "def"]

    # another scope, another choice and another thread count (another machine key) are other files
    measured("demo", {"rows": (1,)}, ["c"], measure)
    measured("other", {"rows": (1, 2)}, ["c"], measure)
    torch.set_num_threads(2)  # the autouse one_thread fixture restores the count
    measured("demo", {"rows": (1, 2)}, ["c"], measure)
    assert measure.measured[3:] == ["c", "c", "c"]
    assert len(list((isolated_home / "draftops_home" / "machine_choice").rglob("*.json"))) == 4


@pytest.mark.parametrize("content", ["{not json", '{"machine": "other", "scope": {}, "items": {}}', '["a list"]',
                                     '{"machine": KEY, "scope": {}, "items": {"c": "unparsable"}}'])
def test_an_unusable_cache_file_is_measured_again_and_rewritten(isolated_home, quiet, content):
    path = cache_file("demo", {})
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", json.dumps(machine_key())))  # the last: an item the client refuses
    measure = CountingMeasure()
    assert measured("demo", {}, ["c"], measure, parse=lambda v: (str(v[0]), int(v[1]))) == {"c": ("c", 1)}
    assert measure.measured == ["c"]
    assert json.loads(path.read_text())["items"] == {"c": ["c", 1]}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_timings_from_a_busy_machine_serve_this_process_but_are_not_cached(isolated_home, monkeypatch):
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: "load 6.1 on 2 CPUs")
    monkeypatch.setattr(machine_choice, "UNSAVED", {})
    measure = CountingMeasure()
    with pytest.warns(BusyMachineWarning, match=r"demo: timed on a busy machine \(load 6.1 on 2 CPUs\); used by this "
                                                r"process and not cached"):
        assert measured("demo", {}, ["c"], measure) == {"c": ["c", 1]}
    assert not cache_file("demo", {}).exists()
    assert measured("demo", {}, ["c"], measure) == {"c": ["c", 1]} and measure.measured == ["c"]  # not timed again

    monkeypatch.setattr(machine_choice, "UNSAVED", {})  # a later process, on a quiet machine: timed again and kept
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)
    measured("demo", {}, ["c"], measure)
    assert measure.measured == ["c", "c"] and cache_file("demo", {}).exists()


def test_a_choice_that_decides_the_output_is_cached_from_a_busy_machine_too(isolated_home, monkeypatch):
    """A killed job's rerun must decide as the first run did: the first timing stands, busy or not."""
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: "2 other runnable threads on 2 CPUs")
    measure = CountingMeasure()
    with pytest.warns(BusyMachineWarning, match="cached in .* all the same"):
        measured("demo", {}, ["c"], measure, pins_output=True)
    assert json.loads(cache_file("demo", {}).read_text())["items"] == {"c": ["c", 1]}
    monkeypatch.setattr(machine_choice, "UNSAVED", {})  # a rerun reads the file
    assert measured("demo", {}, ["c"], measure, pins_output=True) == {"c": ["c", 1]}
    assert measure.measured == ["c"]


def test_a_measurement_that_is_no_timing_ignores_the_machine_and_its_load(isolated_home, monkeypatch):
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: pytest.fail("asked whether the machine is busy"))
    assert machine_choice.measured_once("replay", {"n": 1}, lambda: {"2": 1.5}, timed=False) == {"2": 1.5}
    path = cache_file("replay", {"n": 1}, timed=False)
    assert "threads" not in path.name and json.loads(path.read_text())["machine"] is None
    torch.set_num_threads(2)
    assert machine_choice.measured_once("replay", {"n": 1}, lambda: pytest.fail("replayed again"), timed=False) == {
        "2": 1.5}


def fake_proc(root, runnable: int, own_states: list[str]):
    """A /proc with a load average of `runnable` runnable threads and this process's threads in `own_states`."""
    (root / "loadavg").parent.mkdir(parents=True, exist_ok=True)
    (root / "loadavg").write_text(f"0.52 0.41 0.30 {runnable}/312 4242\n")
    for i, state in enumerate(own_states):
        task = root / "self" / "task" / str(100 + i)
        task.mkdir(parents=True)
        # a thread's name may hold spaces and parentheses: the state follows the last ")"
        (task / "stat").write_text(f"{100 + i} (pt worker (x) {i}) {state} 1 100 100 0 -1\n")


@pytest.mark.parametrize(("runnable", "own", "cpus", "busy"), [
    (3, ["R", "S"], 4, "2 other runnable threads on 4 CPUs"),  # others hold half the CPUs
    (3, ["R", "S"], 8, None),  # a quarter of them
    (3, ["R", "R", "R"], 2, None),  # the runnable threads are this process's own
    (2, ["R"], 2, "1 other runnable thread on 2 CPUs"),
    (1, ["R"], 1, None),
])
def test_other_processes_holding_half_the_cpus_is_busy(tmp_path, monkeypatch, runnable, own, cpus, busy):
    fake_proc(tmp_path, runnable, own)
    monkeypatch.setattr(machine_choice, "PROC", tmp_path)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert machine_choice.runnable_elsewhere(interval=0) == runnable - own.count("R")
    assert machine_choice.machine_busy() == busy


def test_without_proc_more_load_than_cpus_is_busy(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_choice, "PROC", tmp_path / "none")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert machine_choice.runnable_elsewhere() is None
    monkeypatch.setattr(os, "getloadavg", lambda: (6.1, 5.0, 4.0))
    assert machine_choice.machine_busy() == "load 6.1 on 2 CPUs"
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 5.0, 4.0))
    assert machine_choice.machine_busy() is None


def test_this_process_busy_with_its_own_threads_is_not_other_load():
    """The job's own work (here two threads in torch products, outside the GIL) is not counted against it, as the load
    average would count it. Other processes of the machine may take a core between two reads: the best of a few
    tries."""
    if machine_choice.runnable_elsewhere() is None:
        pytest.skip("no /proc")
    a = torch.randn(256, 256)

    def counts_while_spinning() -> tuple[int, int]:
        before = machine_choice.runnable_elsewhere()
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                a @ a

        spinners = [threading.Thread(target=spin) for _ in range(2)]
        for spinner in spinners:
            spinner.start()
        try:
            return before, machine_choice.runnable_elsewhere()
        finally:
            stop.set()
            for spinner in spinners:
                spinner.join()

    tries = [counts_while_spinning() for _ in range(3)]
    assert any(seen <= max(before, 1) for before, seen in tries), tries


def test_bf16_units_are_either_instruction_set(monkeypatch):
    monkeypatch.setattr(machine_choice, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert machine_choice.bf16_units() == ["avx512_bf16"]
    monkeypatch.setattr(machine_choice, "cpu_flags", lambda: {"amx_bf16", "amx_tile"})
    monkeypatch.setattr(machine_choice, "amx_bf16_usable", lambda: True)
    assert machine_choice.bf16_units() == ["amx_bf16"]
    monkeypatch.setattr(machine_choice, "amx_bf16_usable", lambda: False)  # a VM that traps AMX
    assert machine_choice.bf16_units() == []
    monkeypatch.setattr(machine_choice, "cpu_flags", lambda: {"avx2", "avx512f"})
    assert machine_choice.bf16_units() == []
