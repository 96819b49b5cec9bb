"""The target's one-pass costs, eager and compiled, by the number of tokens fed: what a step (1), a short verify (3)
and a chain verify of γ + 1 = 6 tokens cost on this machine, median of repeated calls at one context.

    PYTHONPATH=$PWD DRAFTOPS_HOME=... python benchmarks/compiled_passes.py --context 256 --tokens 1 3 6

Compiling the graphs takes minutes (untimed); then each round times every width eager and compiled, in turn, so that
a change in the machine's memory speed shows in both. A step that costs more than a 6-token verify means the step's
graph is the slower path (docs/results.md, the CPU runtime).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from decode.runtime.lean import LeanDecoder
from decode.serving.loading import load_model
from pipeline.config import load_config


def median_ms(decoder: LeanDecoder, prompt: torch.Tensor, n: int, reps: int) -> float:
    """Median milliseconds of a pass of `n` tokens after `prompt`, the cache cut back to the prompt each time."""
    cache, context = decoder.new_cache(), prompt.shape[0]
    decoder.forward_logits(prompt, cache, 0, True)
    tokens = torch.randint(0, decoder.model.config.vocab_size, (n,))
    seconds = []
    for rep in range(reps + 3):  # three untimed
        cache.length = context
        begin = time.perf_counter()
        decoder.forward_logits(tokens, cache, context, True)
        if rep >= 3:
            seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds) * 1e3


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 3, 6])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, [])
    model = load_model(cfg.target, device="cpu", dtype="float32", cpu_linear=cfg.cpu_linear).model
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,))
    eager, compiled = LeanDecoder(model), LeanDecoder(model, compiled=True)
    begin = time.time()
    for n in args.tokens:
        median_ms(compiled, prompt, n, reps=1)
    print(f"compiled {len(args.tokens)} widths in {time.time() - begin:.0f} s", flush=True)
    for round_ in range(args.rounds):
        figures = [f"{name} {n}: {median_ms(d, prompt, n, args.reps):.2f} ms"
                   for name, d in (("eager", eager), ("compiled", compiled)) for n in args.tokens]
        print(f"round {round_} (context {args.context}): " + ", ".join(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
