"""Traffic for the real-target jobs of docs/data.md, made from the shipped traffic (or any):

    python -m distill.data.traffic_fixtures multi-turn --out multi.jsonl [--turns 3]
    python -m distill.data.traffic_fixtures recorded --out recorded.jsonl [--config FILE] [key=value ...]

`multi-turn` joins consecutive requests' last user messages into conversations of `--turns` user turns (Spec-Bench's
`turns` shape, no replies), for `traffic.turns=all`. `recorded` has the configured target answer every request once,
greedily with distill's settings (through distill's response cache, so its replies are the greedy responses a
generated job trains on), and writes the conversations with their replies: a log served by the target, for
`distill.responses.source=recorded` with `traffic.served_by` as printed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decode.serving.loading import load_model
from distill.data.responses import cached_responses
from pipeline.config import load_config
from pipeline.traffic import encode_configured, load_traffic, reading_options


def write_multi_turn(source: str, out: Path, turns: int) -> int:
    """Conversations of `turns` user turns from consecutive requests; returns how many were written."""
    requests = load_traffic(source).requests
    written = 0
    with out.open("w") as f:
        for begin in range(0, len(requests) - turns + 1, turns):
            group = requests[begin:begin + turns]
            texts = [r.messages[-1]["content"] for r in group]
            f.write(json.dumps({"id": f"mt-{group[0].id}", "category": group[0].category, "turns": texts}) + "\n")
            written += 1
    return written


def write_recorded(cfg, out: Path) -> str:
    """Every request of the configured traffic with the target's greedy reply; returns the target's fingerprint."""
    d = cfg.distill
    target = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    requests = load_traffic(cfg.traffic.path, **reading_options(cfg.traffic)).requests
    prompts, _ = encode_configured(requests, target.tokenizer, cfg.traffic)
    responses, _, _ = cached_responses(target.model, target.tokenizer, target.fingerprint, requests, prompts,
                                       samples=1, max_new_tokens=d.max_new_tokens,
                                       temperature=d.generation_temperature, batch_size=d.generation_batch_size,
                                       seed=cfg.seed, topk=d.topk, progress=True)
    with out.open("w") as f:
        for request, ids in zip(requests, responses.response_ids):
            reply = target.tokenizer.decode(ids, skip_special_tokens=True).strip()
            # an empty reply (the target ended at once) is left out: the request then trains on nothing
            messages = [*request.messages, *([{"role": "assistant", "content": reply}] if reply else [])]
            f.write(json.dumps({"id": request.id, "category": request.category, "ts": request.ts,
                                "messages": messages}) + "\n")
    return target.fingerprint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distill.data.traffic_fixtures")
    sub = parser.add_subparsers(dest="what", required=True)
    multi = sub.add_parser("multi-turn", help="the traffic's prompts as multi-turn conversations")
    multi.add_argument("--traffic", default="default")
    multi.add_argument("--turns", type=int, default=3)
    multi.add_argument("--out", type=Path, required=True)
    recorded = sub.add_parser("recorded", help="the traffic answered once by the target, as a log with replies")
    recorded.add_argument("--config", default=None)
    recorded.add_argument("--out", type=Path, required=True)
    recorded.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.what == "multi-turn":
        if args.turns < 1:
            parser.error("--turns: at least 1")
        print(f"{write_multi_turn(args.traffic, args.out, args.turns)} conversations of {args.turns} turns "
              f"written to {args.out} (train with traffic.path={args.out} traffic.turns=all)")
        return 0
    cfg = load_config(args.config, args.overrides)
    fingerprint = write_recorded(cfg, args.out)
    print(f"the target's replies written to {args.out}; train on them with traffic.path={args.out} "
          f"distill.responses.source=recorded traffic.served_by={fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
