"""The window test's simulated false alarms and power for a window length and its traffic: windows that differ from
one another keep the test at its level, a daily cycle does not, and `draftops monitor simulate --server` runs it."""
import json

import numpy as np

from monitor.stats.window_simulation import simulate_window_checks, synthetic_windows
from pipeline.cli import main


def test_synthetic_windows_sum_their_requests_in_bounded_pieces():
    windows = synthetic_windows(np.random.default_rng(0), 3, requests_per_window=120_000)
    assert len(windows) == 3 and np.all(windows.n >= 120_000 * 32) and 0.55 < windows.acceptance < 0.75


def test_windows_that_differ_keep_the_level_and_a_daily_cycle_raises_the_false_alarms():
    common = dict(n_baseline=7, n_recent=3, level=0.1, margin=0.0, drops=(0.05,), n_checks=200,
                  requests_per_window=200, pool_size=200, seed=4)
    plain = simulate_window_checks(**common)
    noisy = simulate_window_checks(**common, window_sd=0.03)
    cycle = simulate_window_checks(**common, daily_amplitude=0.05)
    assert plain.false_alarm_ci[0] <= 0.1 <= plain.false_alarm_ci[1] + 0.02
    assert noisy.false_alarm_rate <= 0.1 + 3 * np.sqrt(0.09 / 200)
    assert noisy.power[0.05] < plain.power[0.05]  # the windows' own shifts hide part of a drop
    assert cycle.false_alarm_rate > 0.2 and cycle.daily_amplitude == 0.05
    assert "daily cycle +-0.05 (1 h windows)" in cycle.summary()


def test_simulate_server_with_traffic_per_window_and_replicas(tmp_path, capsys):
    code = main(["monitor", "simulate", "--server", "--requests-per-window", "50", "--replicas", "3", "--checks",
                 "10", "--window-sd", "0.01", "--out", str(tmp_path / "sim"), "--json",
                 f"monitor.state_dir={tmp_path / 'state'}"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["requests_per_window"] == 50 and result["level"] == 0.05 / 4 and result["window_sd"] == 0.01
    assert json.loads((tmp_path / "sim" / "server_simulation.json").read_text()) == result
