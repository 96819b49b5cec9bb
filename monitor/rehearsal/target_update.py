"""`draftops target finetune`: an updated target, to rehearse what a target change does to a deployed draft.

The target answers prompts (the train split of the traffic, or a public prompt set by path) with distill's response
cache, so a demo that has distilled already generates nothing new. The responses are rewritten in another style
(ALL CAPS, or a fixed opening), the target learns them with LoRA (peft) on the response tokens only, and the adapter
is merged back (`merge_and_unload`) into a plain checkpoint written with `pipeline.sources.save_checkpoint`: same
architecture and tokenizer, new weights, new fingerprint.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decode.serving.loading import load_model
from distill.data.responses import cached_responses
from pipeline import metrics
from pipeline.config import DraftopsConfig, TargetUpdateConfig
from pipeline.sources import eos_token_ids, fingerprint_dir, save_checkpoint
from pipeline.tracking import start_run
from pipeline.traffic import encode_configured, load_traffic, reading_options

MARKER_FILE = "target_update.json"


@dataclass
class FinetuneResult:
    path: Path
    base_fingerprint: str
    fingerprint: str
    examples: int
    losses: list[float]
    timings: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None


def restyle(text: str, cfg: TargetUpdateConfig) -> str:
    if cfg.style == "uppercase":
        return text.upper()
    return f"{cfg.prefix} {text.lstrip()}"


def styled_examples(tokenizer, prompts: list[list[int]], responses: list[list[int]], stop_ids: list[int],
                    cfg: TargetUpdateConfig) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, restyled response ids) pairs; a response that ended with a stop token still does."""
    examples = []
    for prompt, response in zip(prompts, responses):
        ended = bool(response) and response[-1] in stop_ids
        text = tokenizer.decode(response[:-1] if ended else response, skip_special_tokens=True)
        if not text.strip():
            continue
        ids = tokenizer(restyle(text, cfg), add_special_tokens=False)["input_ids"] + ([response[-1]] if ended else [])
        keep = max(0, cfg.max_seq_tokens - len(prompt))
        if keep:
            examples.append((list(prompt), ids[:keep]))
    return examples


def sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response batch; labels only on the response tokens (-100 elsewhere)."""
    width = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(examples):
        seq = prompt + response
        input_ids[row, :len(seq)] = torch.tensor(seq)
        attention_mask[row, :len(seq)] = 1
        labels[row, len(prompt):len(seq)] = torch.tensor(response)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device), "labels": labels.to(device)}


def response_loss(causal_lm, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the response tokens; the head runs only where a response token is predicted."""
    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    labels = batch["labels"][:, 1:]
    predicted = labels != -100
    logits = causal_lm.lm_head(hidden[:, :-1][predicted]).float()
    return torch.nn.functional.cross_entropy(logits, labels[predicted])


def prompt_requests(cfg: DraftopsConfig) -> list:
    u = cfg.target_update
    if u.prompts == "traffic":  # exactly distill's selection, so that its cached responses are reused
        traffic = load_traffic(cfg.traffic.path, **reading_options(cfg.traffic))
        requests = traffic.split("train", cfg.traffic.heldout_fraction)
        return requests[:cfg.distill.train_prompts] if cfg.distill.train_prompts else requests
    requests = load_traffic(u.prompts, skip_malformed=True).requests
    return requests[:u.max_prompts] if u.max_prompts else requests


def lora_finetune(model, examples: list[tuple[list[int], list[int]]], cfg: TargetUpdateConfig, *, pad_id: int,
                  seed: int, log_every: int = 10) -> tuple[torch.nn.Module, list[float]]:
    """Train a LoRA adapter on `examples` (cycled in a seeded order) and merge it; returns (merged model, losses)."""
    from peft import LoraConfig, get_peft_model

    n_layers = model.config.num_hidden_layers
    layers = list(range(max(0, n_layers - cfg.lora_last_layers), n_layers)) if cfg.lora_last_layers else None
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules), layers_to_transform=layers, bias="none",
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    peft_model.train()
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        while len(order) < cfg.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        batch = [examples[i] for i in order[:cfg.batch_size]]
        del order[:cfg.batch_size]
        loss = response_loss(model, sft_batch(batch, pad_id, device))  # `model` carries the adapters (in place)
        if not torch.isfinite(loss):
            raise RuntimeError(f"target finetune: non-finite loss at step {step + 1}; try a lower learning_rate")
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in peft_model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            print(f"draftops target finetune: step {step + 1}/{cfg.steps} loss {losses[-1]:.3f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
    merged = peft_model.merge_and_unload()
    return merged.eval(), losses


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished checkpoint into place; an existing `out` is replaced only if it is an earlier update."""
    if out.exists():
        if not (out / MARKER_FILE).exists():
            raise FileExistsError(f"{out} exists and is not an earlier `target finetune` output; choose another "
                                  "target_update.output_dir")
        shutil.rmtree(out)
    tmp.rename(out)


def run_finetune(cfg: DraftopsConfig) -> FinetuneResult:
    """The whole update: responses (cached) → restyle → LoRA → merge → checkpoint (+ resolved config, lineage)."""

    u, d = cfg.target_update, cfg.distill
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    target = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    requests = prompt_requests(cfg)
    if not requests:
        raise ValueError(f"target finetune: no prompts in {u.prompts}")
    prompts, _ = encode_configured(requests, target.tokenizer, cfg.traffic)
    timings["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    # distill's generation settings: with prompts=traffic this is exactly distill's cache entry
    responses, cache_dir, hit = cached_responses(
        target.model, target.tokenizer, target.fingerprint, requests, prompts, samples=d.responses_per_prompt,
        max_new_tokens=d.max_new_tokens, temperature=d.generation_temperature, batch_size=d.generation_batch_size,
        seed=cfg.seed, topk=1, progress=True)
    timings["responses"] = time.perf_counter() - clock
    print(f"draftops target finetune: {len(responses)} target responses {'from the cache' if hit else 'generated'} "
          f"at {cache_dir}", flush=True)
    stop = eos_token_ids(target.model, target.tokenizer)
    examples = styled_examples(target.tokenizer, responses.prompt_ids, responses.response_ids, stop, u)
    if not examples:
        raise ValueError("target finetune: no non-empty responses to restyle")

    clock = time.perf_counter()
    torch.manual_seed(cfg.seed)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop[0]
    merged, losses = lora_finetune(target.model, examples, u, pad_id=pad_id, seed=cfg.seed)
    timings["finetune"] = time.perf_counter() - clock

    clock = time.perf_counter()
    out = Path(u.output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(merged, target.tokenizer, tmp, config=cfg)
    (tmp / MARKER_FILE).write_text(json.dumps({
        "base_source": cfg.target, "base_fingerprint": target.fingerprint, "style": u.style,
        "prompts": u.prompts, "examples": len(examples), "steps": u.steps, "first_loss": losses[0],
        "last_loss": losses[-1]}, indent=1))
    replace_dir(tmp, out)
    fingerprint = fingerprint_dir(out)
    timings["save"] = time.perf_counter() - clock
    result = FinetuneResult(out, target.fingerprint, fingerprint, len(examples), losses, timings)
    result.run_id = log_update(cfg, result)
    return result


def log_update(cfg: DraftopsConfig, result: FinetuneResult) -> str:
    """An MLflow run in `draftops-target`: the update's settings, loss curve, times and both fingerprints."""
    import mlflow

    tags = {metrics.TARGET_FINGERPRINT_TAG: result.fingerprint, metrics.BASE_TARGET_FINGERPRINT_TAG:
            result.base_fingerprint, metrics.TARGET_PATH_TAG: str(result.path)}
    with start_run(cfg, "target", run_name=f"finetune-{cfg.target_update.style}", tags=tags) as run:
        mlflow.log_params({f"target_update.{k}": str(v) for k, v in cfg.target_update.model_dump().items()})
        for step, loss in enumerate(result.losses, start=1):
            mlflow.log_metric(metrics.TRAIN_LOSS, loss, step=step)
        mlflow.log_metrics({metrics.TRAIN_FINAL_LOSS: result.losses[-1], "train/examples": result.examples,
                            **{metrics.seconds(k): v for k, v in result.timings.items()}})
    return run.info.run_id
