"""`python -m tests.distill.engine_job URL [URL ...]`: fill an engine response cache of N_PROMPTS prompts and
SAMPLES rounds through the servers at the URLs (DRAFTOPS_HOME from the environment); the process the fault test
kills with SIGKILL mid-way and runs again."""
from __future__ import annotations

import sys

from distill.data.generation.generate import engine_cached_responses
from pipeline.config import load_config
from pipeline.traffic import Request
from tests.distill.fake_engine import STOP

N_PROMPTS, SAMPLES = 40, 2
PROMPTS = [[1, 3 + i % 30, 4 + i % 7, 5 + i] for i in range(N_PROMPTS)]
REQUESTS = [Request(f"q{i:02d}", "c", ({"role": "user", "content": "x"},)) for i in range(N_PROMPTS)]


def run(urls: list[str]):
    cfg = load_config(None, ["distill.responses.engine=openai", f"distill.responses.servers=[{','.join(urls)}]",
                             "distill.responses.concurrency=2"]).distill.responses
    return engine_cached_responses(cfg, "fp", REQUESTS, PROMPTS, samples=SAMPLES, max_new_tokens=8, temperature=0.8,
                                   seed=3, topk=4, stop_ids=[STOP], vocab_size=64)


if __name__ == "__main__":
    made = run(sys.argv[1:])
    print(f"done {len(made.responses)} {made.path}")
