"""The training loop under accelerate: data order, gradient accumulation and synchronization, gradient
clipping, held-out evaluation with best-by-τ selection, and resumable checkpoints. The loss of a micro-batch is
`distill.step.loss_step`.

Resumability: the data order of step s is a pure function of (seed, s) and every random draw of a step is seeded
from (seed, s), so restoring `accelerator.save_state` plus the step number continues exactly where a killed run was.
"""
from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.chains import chain_batch
from distill.checkpoints import latest_checkpoint, load_training_state, save_best, save_training_state
from distill.data.batches import collate, global_batch_indices, micro_batch
from distill.data.onpolicy import draft_continuations
from distill.data.prepare import TrainingData
from distill.heldout_eval import cached_eval, feature_eval
from distill.optimizers import build_optimizers, build_schedules
from distill.step import chain_loss_step, draft_module, feature_loss_step, loss_step
from distill.timings import Timings
from distill.weight_average import WeightAverage
from pipeline.config import DistillConfig, DraftopsConfig
from pipeline.sources import eos_token_ids


class NonFiniteLoss(RuntimeError):
    """The training loss became nan or inf: the run stops and registers nothing."""


def global_batch_and_steps(d: DistillConfig, n_examples: int, num_processes: int) -> tuple[int, int]:
    """(global batch, number of optimizer steps): whole global batches only, `epochs` times, capped by max_steps."""
    global_batch = d.batch_size * num_processes * d.grad_accum
    if n_examples < global_batch:
        raise ValueError(f"{n_examples} training responses cannot fill one global batch of {global_batch} "
                         f"(batch_size {d.batch_size} × {num_processes} processes × grad_accum {d.grad_accum})")
    total_steps = int(d.epochs * (n_examples // global_batch))
    return global_batch, min(total_steps, d.max_steps) if d.max_steps else total_steps


def step_batches(cfg: DraftopsConfig, draft, tokenizer, data: TrainingData, indices: list[int], step: int, *,
                 rank: int, num_processes: int, pad_id: int, chain_stage: bool = False) -> tuple[list[dict], bool]:
    """This process's micro-batches of optimizer step `step` (global batch `indices`), and whether the step is
    on-policy: then (a seeded `onpolicy_fraction` share of steps) the draft's own continuations of the prompts,
    without a cached teacher; else the target's cached responses with their top-k when `teacher` is "topk".
    chain_stage: the on-policy stage's batches, the responses with the draft's chains after them."""
    d = cfg.distill
    onpolicy = d.onpolicy_fraction > 0 and random.Random(f"{cfg.seed}-{step}").random() < d.onpolicy_fraction
    batches = []
    for micro in range(d.grad_accum):
        rows = micro_batch(indices, micro, rank, num_processes, d.batch_size)
        if chain_stage:
            batch = collate(data.train, rows, pad_id=pad_id, token_ids=data.token_ids, with_teacher=False, topk=d.topk,
                            with_features=data.train.features is not None)
            batches.append(chain_batch(batch, draft, d, data.token_ids, seed=cfg.seed * 1_000_003 + step * 97 + micro))
        elif onpolicy:
            sampled = draft_continuations(
                draft, tokenizer, [data.train.prompt_ids[i] for i in rows], token_ids=data.token_ids,
                max_new_tokens=d.max_new_tokens, temperature=d.onpolicy_temperature,
                seed=cfg.seed * 1_000_003 + step * 97 + micro * 7 + rank)
            batches.append(collate(sampled, list(range(len(rows))), pad_id=pad_id, token_ids=data.token_ids,
                                   with_teacher=False, topk=d.topk))
        else:
            batches.append(collate(data.train, rows, pad_id=pad_id, token_ids=data.token_ids,
                                   with_teacher=d.teacher == "topk", topk=d.topk,
                                   with_features=data.train.features is not None,
                                   with_final=data.train.final_hidden is not None))
    return batches, onpolicy


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters to clip, read from the prepared model: FSDP2 replaces a module's parameters by sharded ones
    in prepare, so a list captured before it holds tensors that never receive a gradient."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass
class Prepared:
    """What accelerate prepared: the draft's training module, its optimizers (one, or Muon's and AdamW's), their lr
    schedules (stepped here, once per optimizer step), the parameters clipped, and their moving average where
    `ema_decay` asks for one (what is evaluated and kept)."""

    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    trainable: list[torch.nn.Parameter]
    average: WeightAverage | None = None

    def evaluated(self):
        """The weights held while evaluating and saving: the moving average, else the trained ones."""
        return self.average.applied() if self.average else nullcontext()


def prepare_training(d: DistillConfig, accelerator, draft, total_steps: int) -> Prepared:
    """The optimizers and their schedules over `total_steps` (`distill.optimizers`), the draft's training module
    prepared by accelerate."""
    parameters = trainable_parameters(draft)
    # one fused kernel per step instead of a loop of small ops; left to torch's default where accelerate shards or
    # moves the parameters (FSDP, DDP)
    fused = accelerator.num_processes == 1 and all(p.device.type in ("cpu", "cuda") for p in parameters)
    optimizers = build_optimizers(d, draft, fused=fused)
    # Not passed to prepare(): accelerate would step them once per process and change the schedule with the world size.
    schedulers = build_schedules(d, optimizers, total_steps)
    model, *optimizers = accelerator.prepare(draft_module(d, draft), *optimizers)
    for scheduler in schedulers:
        accelerator.register_for_checkpointing(scheduler)
    trainable = trainable_parameters(model)
    average = WeightAverage(trainable, d.ema_decay) if d.ema_decay else None
    if average:
        accelerator.register_for_checkpointing(average)
    return Prepared(model, optimizers, schedulers, trainable, average)


def resumed_state(d: DistillConfig, accelerator, job_dir: Path, total_steps: int) -> dict:
    """The loop's state (step, history, evaluations, best evaluation): the last checkpoint's with `resume`, else new."""
    last = latest_checkpoint(job_dir / "checkpoints") if d.resume else None
    if last is None:  # the precision goes into every checkpoint: a resumed job keeps it (`train.training_precision`)
        return {"step": 0, "history": [], "evals": [], "best": None, "mixed_precision": accelerator.mixed_precision}
    state = {"mixed_precision": accelerator.mixed_precision, **load_training_state(accelerator, last, job_dir)}
    accelerator.print(f"draftops distill: resuming from {last} (step {state['step']} of {total_steps})")
    return state


def optimizer_step(d: DistillConfig, accelerator, prepared: Prepared, target, draft, data: TrainingData,
                   batches: list[dict], step: int) -> tuple[float, float, int]:
    """Accumulate the gradients of this process's micro-batches, clip and step -> (loss over the global batch,
    gradient norm, loss tokens in the global batch)."""
    model, P = prepared.model, accelerator.num_processes
    local_tokens = sum(int(b["chains"].valid[:, 0].sum() if "chains" in b else b["loss_mask"].sum()) for b in batches)
    global_tokens = accelerator.reduce(torch.tensor(local_tokens, device=accelerator.device), "sum")
    step_loss = torch.zeros((), device=accelerator.device)
    for micro, batch in enumerate(batches):
        # Gradients are synchronized across processes once, on the last micro-batch.
        with nullcontext() if micro == d.grad_accum - 1 else accelerator.no_sync(model):
            if "chains" in batch:
                loss = chain_loss_step(model, batch, d, target=target, num_tokens=global_tokens,
                                       token_ids=data.token_ids, device=accelerator.device)
            elif d.family == "features":
                loss = feature_loss_step(model, batch, d, target=target, layers=draft.feature_layers,
                                         num_tokens=global_tokens, token_ids=data.token_ids, device=accelerator.device)
            else:
                loss = loss_step(model, batch, d, num_tokens=global_tokens, token_ids=data.token_ids,
                                 device=accelerator.device, target=target)
            # DDP averages gradients over processes; the loss is already a share of the global token mean.
            accelerator.backward(loss * P)
        step_loss += loss.detach()
    step_loss = accelerator.reduce(step_loss, "sum").item()
    if not math.isfinite(step_loss):
        raise NonFiniteLoss(f"training loss is {step_loss} at step {step + 1}; stopping without exporting or "
                            "registering anything (try a lower distill.learning_rate or mixed_precision=no)")
    grad_norm = float(accelerator.clip_grad_norm_(prepared.trainable, d.max_grad_norm))
    for optimizer, scheduler in zip(prepared.optimizers, prepared.schedulers):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if prepared.average:
        prepared.average.update()
    return step_loss, grad_norm, int(global_tokens)


def heldout_metrics(cfg: DraftopsConfig, model, target, data: TrainingData, step: int) -> dict:
    """α and τ on the held-out responses at `step`. Every rank evaluates (identical inputs) through the prepared
    model: with FSDP the forward gathers the sharded parameters from all of them."""
    model.eval()
    if cfg.distill.family == "features":
        measured = feature_eval(model, target, data.heldout, data.token_ids, cfg.decode.gamma)
    else:
        measured = cached_eval(model, data.heldout, data.token_ids, cfg.decode.gamma)
    model.train()
    return {"step": step, **measured}


def evaluation_line(metrics: dict, gamma: int) -> str:
    by_position = "  ".join(f"{metrics[f'alpha_t0_pos{j}']:.2f}" for j in range(1, gamma + 1)
                            if f"alpha_t0_pos{j}" in metrics)
    return (f"step {metrics['step']}: α(T=0) {metrics['alpha_t0']:.3f}  α(T=1) ≥ {metrics['alpha_t1']:.3f}  "
            f"τ(γ={gamma}, T=0) {metrics['tau_t0']:.2f}"
            + (f"  α(T=0) by draft position {by_position}" if by_position else ""))


def train_loop(cfg: DraftopsConfig, accelerator, target, tokenizer, draft, data: TrainingData, job_dir: Path,
               timings: Timings) -> tuple[list[dict], list[dict], dict | None]:
    """Train `draft` in place; returns (per-step history, evaluations, best evaluation). The best weights by τ are
    in job_dir/best."""
    d = cfg.distill
    n = len(data.train)
    global_batch, offpolicy_steps = global_batch_and_steps(d, n, accelerator.num_processes)
    total_steps = offpolicy_steps + d.onpolicy_steps  # the chain stage after the epochs, at the schedule's floor
    select = "tau_t0" if cfg.decode.temperature == 0 else "tau_t1"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(target, tokenizer)[0]
    prepared = prepare_training(d, accelerator, draft, offpolicy_steps)
    state = resumed_state(d, accelerator, job_dir, total_steps)
    bar = tqdm(total=total_steps, initial=state["step"], desc="distill", unit="step",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    lengths = [len(p) + len(r) for p, r in zip(data.train.prompt_ids, data.train.response_ids)]
    tokens_seen, started = 0, time.perf_counter()
    for step in range(state["step"], total_steps):
        with timings.measure("training"):
            indices = global_batch_indices(n, step, global_batch, cfg.seed, lengths)
            batches, onpolicy = step_batches(cfg, draft, tokenizer, data, indices, step, rank=accelerator.process_index,
                                             num_processes=accelerator.num_processes, pad_id=pad_id,
                                             chain_stage=step >= offpolicy_steps)
            loss, grad_norm, tokens = optimizer_step(d, accelerator, prepared, target, draft, data, batches, step)
        tokens_seen += tokens
        state["step"] = step + 1
        state["history"].append({"step": step + 1, "loss": loss, "lr": prepared.schedulers[-1].get_last_lr()[0],
                                 "grad_norm": grad_norm, "tokens": tokens, "onpolicy": onpolicy,
                                 "stage": "chains" if step >= offpolicy_steps else "epochs"})
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_seen / max(time.perf_counter() - started, 1e-9):.0f}")
        bar.update(1)
        if state["step"] % d.eval_every == 0 or state["step"] == total_steps:
            with timings.measure("eval"), prepared.evaluated():
                metrics = heldout_metrics(cfg, prepared.model, target, data, state["step"])
                state["evals"].append(metrics)
                if state["best"] is None or metrics[select] > state["best"][select]:
                    state["best"] = metrics
                    save_best(accelerator, prepared.model, job_dir / "best")
                if accelerator.is_main_process:
                    bar.write(evaluation_line(metrics, cfg.decode.gamma))
        if state["step"] % d.checkpoint_every == 0 and state["step"] < total_steps:
            with timings.measure("checkpoints"):
                save_training_state(accelerator, job_dir / "checkpoints", state["step"], state, d.keep_checkpoints)
    bar.close()
    return state["history"], state["evals"], state["best"]
