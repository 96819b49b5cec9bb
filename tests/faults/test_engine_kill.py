"""kill -9 during engine generation, then a rerun: the job completes, the cache holds every response once, and only
the requests in flight at the kill are asked twice."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from distill.data.responses import load_responses
from tests.distill import engine_job
from tests.distill.fake_engine import FakeEngine, Faults, answer

ROOT = Path(__file__).resolve().parents[2]


def journal_lines(home: Path) -> int:
    found = list((home / "cache" / "responses").glob("*/engine-journal.jsonl"))
    return found[0].read_bytes().count(b"\n") if found else 0


def test_kill_9_during_engine_generation_then_a_rerun_completes_with_each_response_once(tmp_path):
    home = tmp_path / "draftops_home"
    env = {**os.environ, "DRAFTOPS_HOME": str(home), "PYTHONPATH": str(ROOT)}
    total = engine_job.N_PROMPTS * engine_job.SAMPLES
    with FakeEngine("llamacpp", faults=Faults(delay_s=0.05)) as a, \
            FakeEngine("llamacpp", faults=Faults(delay_s=0.05)) as b:
        job = subprocess.Popen([sys.executable, "-m", "tests.distill.engine_job", a.url, b.url], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while journal_lines(home) < total // 3 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert job.poll() is None, f"the job ended before it was killed: {job.stdout.read().decode()[-2000:]}"
        job.send_signal(signal.SIGKILL)
        job.wait()
        time.sleep(1.0)  # the fake servers finish answering what was in flight at the kill before they are counted
        kept = journal_lines(home)
        assert 0 < kept < total
        asked_before = Counter(a.answered) + Counter(b.answered)
        made = engine_job.run([a.url, b.url])  # the rerun, in this process
        asked = Counter(a.answered) + Counter(b.answered)
    assert not made.hit and len(made.responses) == total
    assert sorted(made.responses.request_ids) == sorted(set(made.responses.request_ids))  # each response once
    for sample in range(engine_job.SAMPLES):
        part = load_responses(made.path / f"sample-{sample}")
        assert part.request_ids == [f"{r.id}#{sample}" for r in engine_job.REQUESTS]
    for r, (prompt, response) in enumerate(zip(made.responses.prompt_ids, made.responses.response_ids)):
        sample, index = divmod(r, engine_job.N_PROMPTS)
        seed = 0 if sample == 0 else (3 + sample) * 1_000_003 + index * 7_919
        assert response == answer(prompt, 0.0 if sample == 0 else 0.8, seed, 8, 4)[0]
    # asked twice: at most the requests in flight at the kill (2 servers x 2 slots), never one already journaled
    twice = [key for key, n in asked.items() if n > 1]
    assert len(twice) <= 4 and all(asked_before[key] == 1 for key in twice)
    assert sum(asked.values()) <= total + 4 and kept + (sum(asked.values()) - sum(asked_before.values())) >= total
    assert not (made.path / "engine-journal.jsonl").exists()
