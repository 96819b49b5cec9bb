"""The fleet read through the monitor's own window store: replicas of three engines (vLLM read per engine core,
llama.cpp, SGLang), their verdicts, one down or all down, the check reading the service's scrapes, and the test that
names a replica parting from the others (its false alarms and power, simulated)."""
import json

import numpy as np
import pytest

from monitor.check.decision import Decision, Status, with_fleet
from monitor.fleet.counters import ServerMetricsError, SpecCounters
from monitor.fleet.verdicts import evaluate, outlier_tests, read_fleet
from monitor.fleet.window_store import ReplicaWindows, Window, load_store, scrape_due, scrape_fleet, store_path
from monitor.stats.false_alarms import BetaBinomialTraffic
from monitor.stats.window_simulation import synthetic_windows
from pipeline.config import load_config
from tests.monitor.fleet.test_counters import LLAMACPP, RECORDED, plus, vllm_text, with_second_engine
from tests.monitor.fleet.test_sglang import SGLANG

VLLM_URL, LLAMA_URL, SGLANG_URL = "http://10.0.0.5:8000/metrics", "http://10.0.0.6:8080/metrics", \
    "http://10.0.0.7:30000/metrics"


def fleet_config(tmp_path, **monitor):
    engines = [{"url": VLLM_URL, "replica": "vllm-a", "per_core": True}, {"url": LLAMA_URL},
               {"url": SGLANG_URL, "kind": "sglang", "replica": "sglang-a"}]
    return load_config(None, [f"monitor.state_dir={tmp_path}", f"monitor.engines={json.dumps(engines)}",
                              *(f"monitor.{k}={v}" for k, v in monitor.items())])


class Pages:
    """What each endpoint answers now; an endpoint set to None is down."""

    def __init__(self):
        self.vllm = with_second_engine(vllm_text(RECORDED), "deepseek-v4-flash")
        self.llama, self.sglang = LLAMACPP, SGLANG

    def __call__(self, url, timeout):
        page = {VLLM_URL: self.vllm, LLAMA_URL: self.llama, SGLANG_URL: self.sglang}[url]
        if page is None:
            raise ServerMetricsError(f"{url}: server unreachable: [Errno 111] Connection refused")
        return page

    def advance(self):
        self.vllm = with_second_engine(vllm_text(plus(RECORDED, 100, 500, 300, (90, 80, 60, 40, 30))),
                                       "deepseek-v4-flash")
        for name, before, after in (("draft_tokens", 2160, 2660), ("accepted_tokens", 2105, 2405),
                                    ("drafts", 552, 652)):
            self.llama = self.llama.replace(f"spec_decode_num_{name}_total {before}",
                                            f"spec_decode_num_{name}_total {after}")
        self.sglang = self.sglang.replace("} 0.625", "} 0.59").replace("} 100000.0", "} 101000.0")


def test_each_replica_its_windows_engine_cores_one_by_one(tmp_path):
    cfg, pages = fleet_config(tmp_path), Pages()
    first = scrape_fleet(cfg, "1", pages)
    assert list(first) == ["vllm-a/engine=0", "vllm-a/engine=1", "10.0.0.6:8080", "sglang-a"]
    assert all(r.latest is None and "first reading" in r.notes[0] for r in first.values())
    pages.advance()
    second = scrape_fleet(cfg, "1", pages)
    core0, core1 = second["vllm-a/engine=0"].latest.counters, second["vllm-a/engine=1"].latest.counters
    assert (core0.draft_tokens, core0.accepted) == (500, 300)  # engine 0 advanced; engine 1 (half of it) too
    assert (core1.draft_tokens, core1.accepted) == (250, 150)
    assert second["10.0.0.6:8080"].latest.counters == SpecCounters("llamacpp", 100, 500, 300, (0.0, 0.0, 0.0, 0.0))
    assert second["sglang-a"].latest.counters == SpecCounters("sglang", 1000, 1.0, 0.59)
    assert second["vllm-a/engine=0"].engine == "vllm" and second["sglang-a"].engine == "sglang"
    store = load_store(store_path(cfg))
    assert sorted(store["replicas"]) == sorted(second) and store["scraped_at"] is not None


def test_one_replica_down_is_a_note_and_every_replica_down_an_error(tmp_path):
    cfg, pages = fleet_config(tmp_path, scrape_interval_minutes=0), Pages()
    read_fleet(cfg, "1", pages)
    pages.llama = None
    one_down = read_fleet(cfg, "1", pages)
    assert one_down.verdict == "idle" and one_down.named("unreachable") == ["10.0.0.6:8080"]  # no traffic since
    decision = with_fleet(Decision(Status.OK, None), one_down)
    assert decision.status is Status.OK
    assert ("replica 10.0.0.6:8080 unreachable: http://10.0.0.6:8080/metrics: server unreachable: [Errno 111] "
            "Connection refused") in decision.notes
    pages.vllm = pages.sglang = None
    all_down = read_fleet(cfg, "1", pages)
    assert all_down.verdict == "ERROR"
    assert all_down.named("unreachable") == ["vllm-a/engine=0", "vllm-a/engine=1", "10.0.0.6:8080", "sglang-a"]
    decision = with_fleet(Decision(Status.DRIFT, None, ["paired: ..."]), all_down)
    assert decision.status is Status.ERROR and decision.reasons[0].startswith("no serving replica could be read")
    assert decision.notes[0] == "also: paired: ..."


def test_a_check_reads_the_windows_the_service_scraped_and_scrapes_when_they_are_old(tmp_path):
    cfg, pages = fleet_config(tmp_path, scrape_interval_minutes=60), Pages()
    assert scrape_due(cfg)
    assert read_fleet(cfg, "1", pages).source == "scrape"
    assert not scrape_due(cfg)
    assert read_fleet(cfg, "1", pages).source == "store"
    store = load_store(store_path(cfg))
    store["scraped_at"] -= 3601
    store_path(cfg).write_text(json.dumps(store))
    assert scrape_due(cfg)


def windows(values: list[tuple[float, float]], version="1", start=0) -> list[Window]:
    return [Window(f"t{start + i}", f"t{start + i + 1}", version, SpecCounters("vllm", n / 5, n, a))
            for i, (a, n) in enumerate(values)]


def replica(name, baseline, recent) -> ReplicaWindows:
    return ReplicaWindows(name, None, "vllm", windows(baseline), windows(recent, start=len(baseline)),
                          windows(recent, start=len(baseline))[-1])


def test_verdicts_the_summed_windows_and_a_note_when_windows_are_too_few_to_alarm(tmp_path):
    cfg = load_config(None, ["monitor.server_baseline_windows=2", "monitor.server_recent_windows=2"])
    steady = [(3250, 5000), (3300, 5000)]
    fleet = evaluate({"a": replica("a", steady, steady), "b": replica("b", steady, [(2500, 5000), (2550, 5000)]),
                      "c": ReplicaWindows("c", None, "vllm", windows(steady), windows(steady[:1]),
                                          Window("t2", "t3", "1", SpecCounters("vllm", 0, 0, 0)))}, cfg, "store")
    assert [r.verdict for r in fleet.replicas] == ["OK", "OK", "idle"]  # 2 + 2 windows cannot reach p < 0.05 / 3
    assert fleet.notes == ["2 baseline and 2 recent windows can never reach p < 0.0167 (level / 3 tests): raise "
                           "monitor.server_baseline_windows"]
    assert fleet.pooled.n_baseline_prompts == 2 and fleet.latest.counters.draft_tokens == 10000


def overdispersed(rng, k, drop=0.0):
    w = synthetic_windows(rng, k, BetaBinomialTraffic(), requests_per_window=20)
    acc = np.clip(w.acc - drop * w.n, 0, None)
    return list(zip(acc, w.n))


@pytest.mark.parametrize("drop, low, high", [(0.0, 0.0, 0.09), (0.10, 0.55, 1.0)])
def test_the_replica_parting_from_the_others_is_named_at_about_the_level_and_found(drop, low, high):
    """Four replicas with windows of 20 beta-binomial requests (correlated tokens): with nothing different the rate
    of naming any replica stays near the level (0.05); one replica 10 points lower is named most of the time, and
    another one about as rarely as a false alarm."""
    rng = np.random.default_rng(3)
    named = []
    for _ in range(150):
        fleet = {f"r{i}": replica(f"r{i}", overdispersed(rng, 7), overdispersed(rng, 3, drop if i == 0 else 0.0))
                 for i in range(4)}
        tests = outlier_tests(fleet, 0.05)
        named.append([name for name, t in tests.items() if t.named])
    found = np.mean(["r0" in n for n in named]) if drop else np.mean([bool(n) for n in named])
    assert low <= found <= high
    assert np.mean([any(name != "r0" for name in n) for n in named]) <= 0.09
