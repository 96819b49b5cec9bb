"""The engine data source fails closed, in bounded time, in one line: `draftops distill` against a fake server that
answers wrongly (one per case) ends with exit 2 and one line naming the server and what it answered within BOUND_S,
trains and registers nothing and keeps the journal of the responses it finished; `draftops distill --init-only`
against a good server then completes the data with each response once, asking only for the missing ones."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from distill.data.responses import load_responses
from pipeline.cli import main
from pipeline.config import save_config
from tests.distill.fake_engine import FakeEngine, Faults
from tests.distill.tiny_job import tiny_config

TRAIN_PROMPTS, SAMPLES = 15, 2  # 30 requests
# the failing run's limit at these settings: a 1 s deadline per request, no retrying past 3 s without an answer
BOUND_S = 25.0
ENGINE = ["distill.responses.engine=openai", "distill.responses.concurrency=2", "distill.responses.timeout=1",
          "distill.responses.retries=50", "distill.responses.give_up_after=3", f"distill.train_prompts={TRAIN_PROMPTS}",
          f"distill.responses_per_prompt={SAMPLES}", "distill.max_new_tokens=8"]

CASES = {
    "a string top_logprobs entry once in 30 replies": (Faults(string_entry_at=17), "a top_logprobs entry is a str"),
    "string log-probs in every reply": (Faults(string_logprobs=True), "is a str, not a number"),
    "no top-k": (Faults(no_topk=True), "no top-k log-probs at any token"),
    "a short top-k from the 9th reply": (Faults(short_topk=True, bad_from=9), "holds 1 of the 8 entries the others"),
    "an id outside the vocabulary": (Faults(bad_token=True), "token id 100000 is outside the target's vocabulary"),
    "another model answering": (Faults(answer_model="other/model", bad_from=5), "answered by model 'other/model'"),
    "HTTP 500 forever": (Faults(error_status=500), "HTTP 500"),
    "invalid JSON": (Faults(not_json=True), "a body that is not JSON"),
    "a body cut mid-way": (Faults(cut_first=10**6), "a body cut short (40 bytes of 80)"),
    "1 byte/s": (Faults(trickle_s=1.0), "no whole answer within 1 s"),
}


def journal_lines(home: Path) -> int:
    found = list((home / "cache" / "responses").glob("*/engine-journal.jsonl"))
    return found[0].read_bytes().count(b"\n") if found else 0


def failing_run(tmp_path, capsys, urls: list[str]) -> tuple[str, Path]:
    """`draftops distill` through `urls`: exit 2 within BOUND_S, one line, nothing trained or registered."""
    config = save_config(tiny_config(tmp_path, *ENGINE, f"distill.responses.servers=[{','.join(urls)}]"),
                         tmp_path / "config.yaml")
    capsys.readouterr()
    start = time.monotonic()
    assert main(["distill", "--config", str(config)]) == 2
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("draftops")]
    assert len(said) == 1 and lines[-1] == said[0] and "Traceback" not in err, err[-3000:]
    assert elapsed < BOUND_S, f"{elapsed:.1f} s: {said[0]}"
    assert not (tmp_path / "mlflow.db").exists() and not list((tmp_path / "out").glob("**/result.json"))
    return said[0], config


def rerun_completes_each_response_once(tmp_path, capsys, config: Path, kept: int) -> None:
    with FakeEngine() as good:
        assert main(["distill", "--config", str(config), "--init-only",
                     f"distill.responses.servers=[{good.url}]"]) == 0, capsys.readouterr().err[-3000:]
        assert good.requests == TRAIN_PROMPTS * SAMPLES - kept and set(good.seen.values()) == {1}
    entries = [p.parent for p in (tmp_path / "draftops_home" / "cache" / "responses").glob("*/engine.json")]
    assert len(entries) == 1 and not (entries[0] / "engine-journal.jsonl").exists()
    for sample in range(SAMPLES):
        ids = load_responses(entries[0] / f"sample-{sample}").request_ids
        assert len(ids) == len(set(ids)) == TRAIN_PROMPTS


@pytest.mark.parametrize("case", CASES)
def test_a_bad_engine_is_one_line_and_exit_2_in_bounded_time_then_a_rerun_completes(tmp_path, capsys, case):
    faults, reason = CASES[case]
    with FakeEngine(faults=faults) as bad:
        line, config = failing_run(tmp_path, capsys, [bad.url])
        kept = journal_lines(tmp_path / "draftops_home")
    assert line.startswith(f"draftops distill: error: {bad.url}: request ") and reason in line, line
    assert f"{TRAIN_PROMPTS * SAMPLES - kept} of {TRAIN_PROMPTS * SAMPLES} requests remain" in line, line
    if faults.bad_from > 1 or faults.string_entry_at:
        assert kept > 0  # the responses finished before the bad answer are kept for the rerun
    rerun_completes_each_response_once(tmp_path, capsys, config, kept)


def test_two_servers_serving_different_models_is_one_line_and_exit_2(tmp_path, capsys):
    with FakeEngine(served="model-a") as a, FakeEngine(served="model-b") as b:
        line, config = failing_run(tmp_path, capsys, [a.url, b.url])
        assert a.requests == b.requests == 0
    assert "the servers serve different models" in line and a.url in line and b.url in line
    with FakeEngine(served="model-a") as good:
        assert main(["distill", "--config", str(config), "--init-only",
                     f"distill.responses.servers=[{good.url}]"]) == 0
        assert good.requests == TRAIN_PROMPTS * SAMPLES


def test_a_teacher_without_entries_is_never_trained_on(tmp_path):
    """What a cache entry written from answers without top-k would hold: refused before training (the loss would be
    0 and the draft trained on nothing), while a few tokens without entries (the tail bucket's) are fine."""
    import torch

    from distill.data.responses import EmptyTeacher, check_teacher, response_set

    empty = (torch.full((5, 4), float("-inf")).half(), torch.full((5, 4), -1, dtype=torch.int32))
    with pytest.raises(EmptyTeacher, match="only 0 of the 5 training response tokens carry a top-k teacher"):
        check_teacher(response_set([[1, 2]], [[3, 4, 5, 6, 2]], [empty]), tmp_path)
    some = (empty[0].clone(), empty[1].clone())
    some[1][:4, 0], some[0][:4, 0] = 3, -0.1
    check_teacher(response_set([[1, 2]], [[3, 4, 5, 6, 2]], [some]), tmp_path)
