"""`traffic.turns: all`: every assistant turn a training target, answered turn by turn against the target's own
earlier replies; held-out α per turn position, the request kept as the unit."""
from __future__ import annotations

import json
import random

import torch

from distill.data.responses import response_set
from distill.data.turns import turn_responses
from distill.train import run_distill
from pipeline.traffic import Request, load_traffic
from pipeline.turns import request_of, segments, turn_position, turn_request
from tests.conftest import WORDS
from tests.distill.tiny_job import tiny_config

U1, U2, U3 = ({"role": "user", "content": text} for text in ("one", "two", "three"))
A1, A2 = ({"role": "assistant", "content": text} for text in ("uno", "dos"))


def test_segments_of_a_logged_conversation_and_of_spec_bench_turns():
    chat = Request("c", "x", (U1, A1, U2, A2, U3))
    assert segments(chat) == [((U1,), A1), ((U2,), A2), ((U3,), None)]
    assert turn_request(chat, 3, [A1, A2]).messages == (U1, A1, U2, A2, U3)
    mine = {"role": "assistant", "content": "mine"}
    second = turn_request(chat, 2, [mine])
    assert second.messages == (U1, mine, U2) and second.reply == A2 and second.id == "c@2"
    spec_bench = Request("s", "x", (U1,), later=(U2, U3))
    assert [len(added) for added, _ in segments(spec_bench)] == [1, 1, 1]
    assert turn_position("s@3#0") == 3 and request_of("s@3#0") == "s" and turn_position("r@x#1") == 1


def test_later_turns_hold_the_targets_own_earlier_replies():
    requests = [Request("a", "x", (U1,), later=(U2,)), Request("b", "x", (U1, A1, U3))]
    asked = []

    def encode(turns):
        asked.append(turns)
        return [[len(t.messages)] for t in turns]

    def respond(turns, prompts):
        rows = [(torch.zeros(1, 2, dtype=torch.float16), torch.zeros(1, 2, dtype=torch.int32)) for _ in turns]
        return response_set(prompts, [[7] for _ in turns], rows), None, False

    made = turn_responses(requests, "all", encode, respond, lambda ids: f"said {ids}")
    assert made.turns == 4 and made.positions == [1, 1, 2, 2]
    second = {t.id: t.messages for t in asked[1]}
    assert second["a@2"] == (U1, {"role": "assistant", "content": "said [7]"}, U2)
    assert second["b@2"] == (U1, {"role": "assistant", "content": "said [7]"}, U3)  # the logged A1 replaced
    recorded = turn_responses(requests, "all", encode, respond, str, recorded=True)
    assert recorded.turns == 1 and asked[-1][0].messages == (U1,) and asked[-1][0].reply == A1


def write_multi_turn(path, n=40):
    rng = random.Random(1)
    with path.open("w") as f:
        for i in range(n):
            turns = [" ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(3, 7))) for _ in range(1 + i % 3)]
            f.write(json.dumps({"id": f"m{i:03d}", "category": "tiny", "turns": turns}) + "\n")
    return path


def test_a_tiny_job_trains_on_every_turn_and_reports_alpha_by_turn(isolated_home, capsys):
    traffic = write_multi_turn(isolated_home / "multi.jsonl")
    cfg = tiny_config(isolated_home, f"traffic.path={traffic}", "traffic.turns=all", "distill.max_steps=4",
                      "distill.register_model=false")
    result = run_distill(cfg)
    loaded = load_traffic(traffic)
    expected = sum(1 + len(r.later) for r in loaded.split("train", cfg.traffic.heldout_fraction))
    assert result.metrics["train_turns"] == expected > len(loaded.split("train", cfg.traffic.heldout_fraction))
    assert result.metrics["train_responses"] == expected * cfg.distill.responses_per_prompt
    assert {"alpha_t0_turn1", "alpha_t0_turn2"} <= set(result.metrics)
    out = capsys.readouterr().out
    assert f"trained on {expected} assistant turns" in out and "by turn position 1:" in out
