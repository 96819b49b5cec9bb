"""`distill.responses.source: recorded`: the log's replies trained on with the target's teacher-forced top-k, no
generation; refused for a log served by another model; the monitor's retraining after a target update generates."""
from __future__ import annotations

import json
import random

import pytest

import distill.data.prepare as training_data
from distill.data.recorded import RecordedMismatch, batched_teacher_topk, reply_ids
from distill.data.responses import teacher_forced_topk
from distill.train import run_distill
from monitor.check.retrain import challenger_config
from pipeline.sources import resolve_model
from pipeline.traffic import Request, load_traffic
from tests.conftest import WORDS
from tests.distill.tiny_job import tiny_config


def write_recorded_log(path, n=48):
    rng = random.Random(2)

    def words(low, high):
        return " ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(low, high)))

    with path.open("w") as f:
        for i in range(n):
            messages = [{"role": "user", "content": words(3, 8)}, {"role": "assistant", "content": words(4, 10)}]
            f.write(json.dumps({"id": f"r{i:03d}", "category": "tiny", "messages": messages}) + "\n")
    return path


def test_recorded_replies_skip_generation_and_train(isolated_home, monkeypatch):
    log = write_recorded_log(isolated_home / "recorded.jsonl")
    cfg = tiny_config(isolated_home, f"traffic.path={log}", "distill.responses.source=recorded",
                      f"traffic.served_by={isolated_home / 'target'}", "distill.max_steps=4",
                      "distill.register_model=false")
    monkeypatch.setattr(training_data, "generation_model",
                        lambda *a, **k: pytest.fail("recorded replies generated training responses"))
    asked = []
    real = training_data.cached_responses
    monkeypatch.setattr(training_data, "cached_responses",
                        lambda *a, **k: asked.append((len(a[3]), k["samples"])) or real(*a, **k))
    result = run_distill(cfg)
    assert asked == [(6, 1)]  # the held-out responses only: what α is measured on
    train = load_traffic(log).split("train", cfg.traffic.heldout_fraction)
    assert result.metrics["train_responses"] == len(train) and result.teacher.startswith("recorded replies of")


def test_a_log_served_by_another_model_is_refused_in_one_line(isolated_home):
    log = write_recorded_log(isolated_home / "recorded.jsonl")
    for served in ("traffic.served_by=some-other-model", None):
        cfg = tiny_config(isolated_home, f"traffic.path={log}", "distill.responses.source=recorded",
                          *([served] if served else []))
        with pytest.raises(RecordedMismatch) as err:
            run_distill(cfg)
        assert "\n" not in str(err.value) and "traffic.served_by" in str(err.value)


def test_the_monitors_retraining_after_a_target_update_generates_again(isolated_home):
    cfg = tiny_config(isolated_home, "distill.responses.source=recorded", "monitor.retrain_init=config",
                      f"traffic.served_by={isolated_home / 'target'}")
    assert challenger_config(cfg).distill.responses.source == "recorded"
    updated = cfg.model_copy(update={"traffic": cfg.traffic.model_copy(update={"served_by": "the-old-target"})})
    assert challenger_config(updated).distill.responses.source == "generate"


def test_a_reply_is_its_templated_turn_and_its_top_k_is_the_targets(isolated_home):
    cfg = tiny_config(isolated_home)
    target = resolve_model(cfg.target)
    request = Request("r", "x", ({"role": "user", "content": "what is the sum"},),
                      reply={"role": "assistant", "content": "the sum is code"})
    stop = [target.tokenizer.eos_token_id]
    ids = reply_ids(request, target.tokenizer, None, stop, max_new_tokens=64)
    assert ids[-1] == stop[0] and target.tokenizer.decode(ids[:-1]).strip() == "the sum is code"
    assert len(reply_ids(request, target.tokenizer, None, stop, max_new_tokens=2)) == 2
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    replies = [[10, 11], [12, 13, 2]]
    batched = batched_teacher_topk(target.model, prompts, replies, 4, batch_size=2)
    single = teacher_forced_topk(target.model, [p + r for p, r in zip(prompts, replies)], [4, 3], 4)
    for (values, indices), (v, i) in zip(batched, single):
        assert indices.tolist() == i.tolist() and values.float().sub(v.float()).abs().max() < 1e-2


def test_the_fixture_scripts_write_multi_turn_and_recorded_traffic(isolated_home):
    from distill.data.traffic_fixtures import main

    assert main(["multi-turn", "--out", str(isolated_home / "multi.jsonl"), "--turns", "3"]) == 0
    multi = load_traffic(isolated_home / "multi.jsonl").requests
    assert multi and all(len(r.later) == 2 for r in multi)
    cfg = tiny_config(isolated_home)
    assert main(["recorded", "--out", str(isolated_home / "rec.jsonl"), f"target={cfg.target}", "device=cpu",
                 f"traffic.path={cfg.traffic.path}", "distill.max_new_tokens=6"]) == 0
    recorded = load_traffic(isolated_home / "rec.jsonl").requests
    assert len(recorded) == 48 and all(r.reply is not None for r in recorded)
