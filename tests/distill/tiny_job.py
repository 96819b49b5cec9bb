"""A complete tiny distill job: a 2-layer hidden-64 Llama target with a word-level tokenizer, a generated traffic
file, and a config that runs in seconds on a CPU."""
from __future__ import annotations

import json
import random
from pathlib import Path

from pipeline.config import DraftopsConfig, load_config
from tests.conftest import WORDS, make_tiny_model, make_tokenizer


def write_target(path: Path) -> Path:
    from pipeline.sources import save_checkpoint

    tokenizer = make_tokenizer(extra_words=40)
    return save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, path)


def write_traffic(path: Path, n: int = 48) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            words = " ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(3, 9)))
            f.write(json.dumps({"id": f"r{i:03d}", "category": "tiny", "prompt": words}) + "\n")
    return path


def tiny_config(root: Path, *overrides: str) -> DraftopsConfig:
    target = root / "target"
    if not target.exists():
        write_target(target)
    traffic = root / "traffic.jsonl"
    if not traffic.exists():
        write_traffic(traffic)
    return load_config(None, [
        "distill.family=layers", f"target={target}", "device=cpu", "seed=0", f"traffic.path={traffic}",
        "traffic.heldout_fraction=0.25",
        f"tracking.uri=sqlite:///{root}/mlflow.db", "tracking.system_metrics=false",
        f"distill.output_dir={root}/out", "distill.init_layers=[0]", "distill.draft_vocab_size=24",
        "distill.responses_per_prompt=2", "distill.eval_prompts=6", "distill.max_new_tokens=12",
        "distill.generation_batch_size=16", "distill.topk=8", "distill.epochs=2", "distill.batch_size=4",
        "distill.learning_rate=0.003", "distill.warmup_steps=2", "distill.eval_every=4", "distill.checkpoint_every=3",
        *overrides])
