"""`draftops distill`: one function, `run_distill(cfg)`, that runs the whole job under `accelerate`.

data (target responses + top-k teacher, cached) → draft init (+ reduced vocabulary) → training loop (DDP, gradient
accumulation, mixed precision from accelerate) with resumable checkpoints and held-out α/τ evaluation → export of the
best draft by τ → MLflow run + registered version. Run it directly or through `accelerate launch -m distill.train`.

Resumability: the data order of step s is a pure function of (seed, s) and every random draw of a step is seeded
from (seed, s), so restoring `accelerator.save_state` plus the step number continues exactly where a killed run was.
Checkpoints are written to a temporary folder and renamed into place, so a kill -9 at any moment leaves either the
previous complete checkpoint or the new one.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from distill.responses import ResponseSet, cached_responses, collate
from decode.drafts import frequent_token_ids
from distill.init import init_draft
from distill.losses import distillation_loss, to_student_columns
from pipeline.config import DraftopsConfig
from pipeline.sources import HF_ASSISTANT_DIR, eos_token_ids

STATE_FILE = "trainer_state.json"


class NonFiniteLoss(RuntimeError):
    """The training loss became nan or inf: the run stops and registers nothing."""


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def measure(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass
class DistillResult:
    export_dir: Path
    job_dir: Path
    metrics: dict
    history: list[dict]
    evals: list[dict]
    timings: dict[str, float]
    token_ids: torch.Tensor | None
    data_fingerprint: str
    run_id: str | None = None
    version: str | None = None
    alias: str | None = None


# --------------------------------------------------------------------------- data order


def global_batch_indices(n_examples: int, step: int, global_batch: int, seed: int,
                         lengths: list[int] | None = None, group: int = 8) -> list[int]:
    """Example indices of optimizer step `step`: epoch e is a permutation seeded by (seed, e); the tail is dropped.

    With `lengths`, each run of `group` global batches of the permutation is sorted by length before it is cut
    (HF's group_by_length idea), so micro-batches hold similar lengths and little padding.
    """
    steps_per_epoch = n_examples // global_batch
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    order = order[:steps_per_epoch * global_batch]
    if lengths is not None:
        span = group * global_batch
        begin = within // group * span
        order[begin:begin + span] = sorted(order[begin:begin + span], key=lambda i: (-lengths[i], i))
    return order[within * global_batch:(within + 1) * global_batch]


class ResponseLogits(torch.nn.Module):
    """The draft's logits at the masked (response) positions only, [N, V_draft]: the head and the loss skip prompt
    and padding positions. The module accelerate wraps (DDP), so gradient sync still sees every parameter."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, attention_mask, loss_mask):
        hidden = self.draft.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.draft.lm_head(hidden[loss_mask])


def micro_batch(indices: list[int], micro: int, rank: int, num_processes: int, batch_size: int) -> list[int]:
    """Micro-batch `micro` of process `rank`: consecutive slices, so any (processes × accumulation) split of the
    same global batch covers the same examples."""
    begin = (micro * num_processes + rank) * batch_size
    return indices[begin:begin + batch_size]


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------- evaluation


def simulated_tau(per_position: list[list[float]], gamma: int, *, rollouts: int = 16, seed: int = 0) -> float:
    """Tokens per target call from walking each response in blocks of γ, accepting position t with probability α_t.

    With 0/1 acceptances (greedy) the walk is exact and one rollout suffices.
    """
    rng = random.Random(seed)
    tokens = calls = 0
    for alphas in per_position:
        repeats = rollouts if any(0.0 < a < 1.0 for a in alphas) else 1
        for _ in range(repeats):
            t = 0
            while t < len(alphas):
                accepted = 0
                while accepted < gamma and t + accepted < len(alphas) and rng.random() < alphas[t + accepted]:
                    accepted += 1
                step = min(accepted + 1, len(alphas) - t)
                tokens, calls, t = tokens + step, calls + 1, t + step
    return tokens / calls if calls else float("nan")


@torch.inference_mode()
def cached_eval(draft, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int, batch_size: int = 8) -> dict:
    """α and simulated τ on held-out target responses, from the draft alone and the cached target top-k.

    Greedy (T=0) values are exact: the target's argmax is its cached top-1. At T=1, Σ over the cached top-k of
    min(p, q) is a lower bound on α (short by at most the teacher's mass beyond its top k).
    """
    device = next(draft.parameters()).device
    k = responses.topk_indices.shape[1]
    greedy, sampled = [], []
    for begin in range(0, len(responses), batch_size):
        rows = list(range(begin, min(begin + batch_size, len(responses))))
        batch = collate(responses, rows, pad_id=0, token_ids=None, with_teacher=True, topk=k)
        logits = draft(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
        for row in range(len(rows)):
            mask = batch["loss_mask"][row]
            probs = torch.softmax(logits[row][mask.to(device)].float(), -1)
            top_p = batch["teacher"].logprobs[row][mask].float().exp().to(device)
            top_ids = batch["teacher"].indices[row][mask].long().to(device)
            draft_argmax = probs.argmax(-1) if token_ids is None else token_ids.to(device)[probs.argmax(-1)]
            greedy.append((draft_argmax == top_ids[:, 0]).float().tolist())
            sampled.append(torch.minimum(top_p, _draft_probs_at(probs, top_ids, token_ids)).sum(-1).tolist())
    return summarize_acceptance(greedy, sampled, gamma)


def _draft_probs_at(probs: torch.Tensor, target_ids: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """q at the given target ids (0 for ids outside a reduced vocabulary)."""
    columns = to_student_columns(target_ids, token_ids, ignore_index=-1)
    return torch.where(columns >= 0, probs.gather(-1, columns.clamp(min=0)), torch.zeros((), dtype=probs.dtype,
                                                                                          device=probs.device))


def summarize_acceptance(greedy: list[list[float]], sampled: list[list[float]], gamma: int) -> dict:
    def mean(rows):
        values = [a for r in rows for a in r]
        return sum(values) / len(values) if values else float("nan")

    return {"alpha_t0": mean(greedy), "alpha_t1": mean(sampled), "tau_t0": simulated_tau(greedy, gamma),
            "tau_t1": simulated_tau(sampled, gamma)}


def exact_eval(target, draft, responses: ResponseSet, token_ids: torch.Tensor | None, gamma: int) -> dict:
    """α at T=0 and T=1 and simulated τ with the target run alongside (decode.acceptance.analytic_acceptance)."""
    from decode.acceptance import analytic_acceptance

    seqs = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    starts = [len(p) for p in responses.prompt_ids]
    per_t = {t: analytic_acceptance(target, draft, seqs, starts, temperature=t, draft_token_ids=token_ids).per_position
             for t in (0.0, 1.0)}
    return summarize_acceptance(per_t[0.0], per_t[1.0], gamma)


# --------------------------------------------------------------------------- checkpoints


def job_key(cfg: DraftopsConfig, data_fingerprint: str) -> str:
    """Identifies a job for resuming: everything that changes the weights, nothing that only changes bookkeeping."""
    settings = cfg.to_dict()
    settings.pop("tracking", None)
    settings.pop("monitor", None)
    for key in ("resume", "register_model", "checkpoint_every", "keep_checkpoints", "output_dir"):
        settings["distill"].pop(key, None)
    return hashlib.sha256(json.dumps([settings, data_fingerprint], sort_keys=True).encode()).hexdigest()[:12]


def latest_checkpoint(checkpoints: Path) -> Path | None:
    done = sorted(p for p in checkpoints.glob("step-*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def save_training_state(accelerator, checkpoints: Path, step: int, state: dict, keep: int) -> None:
    """accelerate.save_state + our step/best/history, written to a temporary folder and renamed into place."""
    final = checkpoints / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in checkpoints.glob("step-*") if not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_best(accelerator, model, best_dir: Path) -> None:
    """The draft's full weights (gathered by accelerate under FSDP; tied tensors stored once), renamed into place."""
    tmp = best_dir.with_name(best_dir.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.save_model(model, str(tmp), safe_serialization=True)  # a collective: every rank calls it
    if accelerator.is_main_process:
        shutil.rmtree(best_dir, ignore_errors=True)
        os.replace(tmp, best_dir)
    accelerator.wait_for_everyone()


def load_best(cfg: DraftopsConfig, target_model, token_ids: torch.Tensor | None, best_dir: Path):
    """A fresh, plain (unsharded) draft holding the best weights: what export sees whatever the distribution was."""
    from safetensors.torch import load_model as load_safetensors

    draft = init_draft(cfg.distill, target_model, token_ids=token_ids)
    load_safetensors(ResponseLogits(draft), str(best_dir / "model.safetensors"))
    return draft.eval()


# --------------------------------------------------------------------------- on-policy batches


class FullVocabHead(torch.nn.Module):
    """Wraps a reduced lm_head so `generate` sees target-vocabulary logits (the lowest float outside the subset)."""

    def __init__(self, head: torch.nn.Module, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head, self.token_ids, self.vocab_size = head, token_ids, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.head(hidden)
        full = rows.new_full((*rows.shape[:-1], self.vocab_size), torch.finfo(rows.dtype).min)
        return full.index_copy(-1, self.token_ids.to(rows.device), rows)


@torch.no_grad()
def draft_continuations(draft, tokenizer, prompts: list[list[int]], *, token_ids, max_new_tokens: int,
                        temperature: float, seed: int) -> ResponseSet:
    """Continuations sampled from the current draft (the on-policy share of the data); no teacher attached."""
    from transformers import GenerationConfig

    from distill.responses import left_pad

    stop = eos_token_ids(draft, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    head = draft.lm_head
    if token_ids is not None:
        draft.lm_head = FullVocabHead(head, token_ids, draft.get_input_embeddings().num_embeddings)
    was_training = draft.training
    try:
        draft.eval()
        ids, mask = left_pad(prompts, pad_id, next(draft.parameters()).device)
        torch.manual_seed(seed)
        out = draft.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=None, top_p=None,
            eos_token_id=stop, pad_token_id=pad_id))
    finally:
        draft.lm_head = head
        draft.train(was_training)
    responses = []
    for tokens in out[:, ids.shape[1]:].tolist():
        length = next((t + 1 for t, tok in enumerate(tokens) if tok in stop), len(tokens))
        responses.append(tokens[:length])
    return ResponseSet([str(i) for i in range(len(prompts))], [list(p) for p in prompts], responses)


# --------------------------------------------------------------------------- the loop


@dataclass
class TrainingData:
    train: ResponseSet
    heldout: ResponseSet
    token_ids: torch.Tensor | None
    fingerprint: str


def train_loop(cfg: DraftopsConfig, accelerator, target, tokenizer, draft, data: TrainingData, job_dir: Path,
               timings: Timings) -> tuple[list[dict], list[dict], dict | None]:
    """Train `draft` in place; returns (per-step history, evaluations, best evaluation). The best weights by τ are
    in job_dir/best."""
    from tqdm.auto import tqdm

    d = cfg.distill
    P, rank = accelerator.num_processes, accelerator.process_index
    global_batch = d.batch_size * P * d.grad_accum
    n = len(data.train)
    if n < global_batch:
        raise ValueError(f"{n} training responses cannot fill one global batch of {global_batch} "
                         f"(batch_size {d.batch_size} × {P} processes × grad_accum {d.grad_accum})")
    total_steps = d.epochs * (n // global_batch)
    if d.max_steps:
        total_steps = min(total_steps, d.max_steps)
    select = "tau_t0" if cfg.decode.temperature == 0 else "tau_t1"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(target, tokenizer)[0]

    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=d.learning_rate, weight_decay=d.weight_decay)
    # Not passed to prepare(): accelerate would step it once per process and change the schedule with the world size.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(
        s, warmup=d.warmup_steps, total=total_steps, min_ratio=d.min_lr_ratio))
    model, optimizer = accelerator.prepare(ResponseLogits(draft), optimizer)
    accelerator.register_for_checkpointing(scheduler)

    checkpoints, best_dir = job_dir / "checkpoints", job_dir / "best"
    state = {"step": 0, "history": [], "evals": [], "best": None}
    last = latest_checkpoint(checkpoints) if d.resume else None
    if last is not None:
        accelerator.load_state(str(last))
        state = json.loads((last / STATE_FILE).read_text())
        accelerator.print(f"draftops distill: resuming from {last} (step {state['step']} of {total_steps})")

    bar = tqdm(total=total_steps, initial=state["step"], desc="distill", unit="step",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    lengths = [len(p) + len(r) for p, r in zip(data.train.prompt_ids, data.train.response_ids)]
    tokens_seen, started = 0, time.perf_counter()
    for step in range(state["step"], total_steps):
        with timings.measure("training"):
            indices = global_batch_indices(n, step, global_batch, cfg.seed, lengths)
            onpolicy = d.onpolicy_fraction > 0 and random.Random(f"{cfg.seed}-{step}").random() < d.onpolicy_fraction
            micro_batches = []
            for micro in range(d.grad_accum):
                rows = micro_batch(indices, micro, rank, P, d.batch_size)
                if onpolicy:
                    sampled = draft_continuations(
                        draft, tokenizer, [data.train.prompt_ids[i] for i in rows],
                        token_ids=data.token_ids, max_new_tokens=d.max_new_tokens, temperature=d.onpolicy_temperature,
                        seed=cfg.seed * 1_000_003 + step * 97 + micro * 7 + rank)
                    batch = collate(sampled, list(range(len(rows))), pad_id=pad_id, token_ids=data.token_ids,
                                    with_teacher=False, topk=d.topk)
                else:
                    batch = collate(data.train, rows, pad_id=pad_id, token_ids=data.token_ids,
                                    with_teacher=d.teacher == "topk", topk=d.topk)
                micro_batches.append(batch)
            local_tokens = sum(int(b["loss_mask"].sum()) for b in micro_batches)
            global_tokens = accelerator.reduce(torch.tensor(local_tokens, device=accelerator.device), "sum")
            step_loss = torch.zeros((), device=accelerator.device)
            for micro, batch in enumerate(micro_batches):
                input_ids = batch["input_ids"].to(accelerator.device)
                attention_mask = batch["attention_mask"].to(accelerator.device)
                loss_mask = batch["loss_mask"].to(accelerator.device)
                if "teacher" in batch:
                    teacher = batch["teacher"][batch["loss_mask"]]
                    teacher = type(teacher)(teacher.logprobs.to(accelerator.device), teacher.indices.to(accelerator.device))
                else:
                    with torch.no_grad():
                        teacher = target(input_ids=input_ids, attention_mask=attention_mask).logits[loss_mask]
                sync = micro == d.grad_accum - 1
                with nullcontext() if sync else accelerator.no_sync(model):
                    logits = model(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
                    selected = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
                    loss = distillation_loss(
                        logits, teacher, selected, loss=d.loss, beta=d.jsd_beta, temperature=d.temperature,
                        token_ids=data.token_ids, labels=batch["labels"].to(accelerator.device)[loss_mask],
                        ce_weight=d.ce_weight, num_tokens=global_tokens)
                    # DDP averages gradients over processes; the loss is already a share of the global token mean.
                    accelerator.backward(loss * P)
                step_loss += loss.detach()
            step_loss = accelerator.reduce(step_loss, "sum").item()
            if not math.isfinite(step_loss):
                raise NonFiniteLoss(f"training loss is {step_loss} at step {step + 1}; stopping without exporting or "
                                    "registering anything (try a lower distill.learning_rate or mixed_precision=no)")
            grad_norm = accelerator.clip_grad_norm_(trainable, d.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        tokens_seen += int(global_tokens)
        state["step"] = step + 1
        state["history"].append({"step": step + 1, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                                 "grad_norm": float(grad_norm), "tokens": int(global_tokens), "onpolicy": onpolicy})
        elapsed = time.perf_counter() - started
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
        bar.update(1)

        if state["step"] % d.eval_every == 0 or state["step"] == total_steps:
            with timings.measure("eval"):
                # Every rank evaluates (identical inputs): with FSDP the forward needs all of them.
                evaluated = accelerator.unwrap_model(model).draft.eval()
                metrics = {"step": state["step"], **cached_eval(evaluated, data.heldout, data.token_ids,
                                                                 cfg.decode.gamma)}
                evaluated.train()
                state["evals"].append(metrics)
                if state["best"] is None or metrics[select] > state["best"][select]:
                    state["best"] = metrics
                    save_best(accelerator, model, best_dir)
                if accelerator.is_main_process:
                    bar.write(f"step {state['step']}: α(T=0) {metrics['alpha_t0']:.3f}  α(T=1) ≥ "
                              f"{metrics['alpha_t1']:.3f}  τ(γ={cfg.decode.gamma}, T=0) {metrics['tau_t0']:.2f}")
        if state["step"] % d.checkpoint_every == 0 and state["step"] < total_steps:
            with timings.measure("checkpoints"):
                save_training_state(accelerator, checkpoints, state["step"], state, d.keep_checkpoints)
    bar.close()
    return state["history"], state["evals"], state["best"]


# --------------------------------------------------------------------------- the job


def make_accelerator(cfg: DraftopsConfig):
    from accelerate import Accelerator
    from accelerate.utils import is_bf16_available

    # cpu=True also when "auto" finds no accelerator: under torchrun that is what makes the ranks form a gloo group.
    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.accelerator.is_available())
    mixed = cfg.distill.mixed_precision
    usable = {"no": True, "fp16": not cpu, "bf16": is_bf16_available()}[mixed]
    if not usable:
        print(f"draftops distill: mixed_precision={mixed} is not available here; training in full precision")
    return Accelerator(cpu=cpu, mixed_precision=mixed if usable else "no")


def prepare_data(cfg: DraftopsConfig, accelerator, target, timings: Timings) -> TrainingData:
    """Target responses on the train split (+ held-out ones for evaluation), cached; the draft vocabulary from them."""
    from pipeline.traffic import encode_prompts, load_traffic

    d = cfg.distill
    traffic = load_traffic(cfg.traffic.path, skip_malformed=cfg.traffic.skip_malformed)
    train_requests = traffic.split("train", cfg.traffic.heldout_fraction)
    if d.train_prompts:
        train_requests = train_requests[:d.train_prompts]
    heldout_requests = traffic.split("heldout", cfg.traffic.heldout_fraction)[:d.eval_prompts]
    if not train_requests or not heldout_requests:
        raise ValueError(f"{traffic.path}: need both train and held-out requests "
                         f"(got {len(train_requests)} and {len(heldout_requests)})")
    common = dict(max_new_tokens=d.max_new_tokens, temperature=d.generation_temperature,
                  batch_size=d.generation_batch_size, seed=cfg.seed, topk=d.topk,
                  progress=accelerator.is_local_main_process)
    with timings.measure("generation_with_teacher_topk"), accelerator.main_process_first():
        prompts, _ = encode_prompts(train_requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        train, train_dir, hit = cached_responses(target.model, target.tokenizer, target.fingerprint, train_requests,
                                                 prompts, samples=d.responses_per_prompt, **common)
        prompts, _ = encode_prompts(heldout_requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        heldout, _, _ = cached_responses(target.model, target.tokenizer, target.fingerprint, heldout_requests,
                                         prompts, samples=1, **common)
    accelerator.print(f"draftops distill: {len(train)} target responses ({train.num_response_tokens} tokens) "
                      f"{'from the cache' if hit else 'generated'} at {train_dir}")
    token_ids = None
    if d.draft_vocab_size:
        token_ids = frequent_token_ids(train.response_ids, d.draft_vocab_size, target.tokenizer.all_special_ids)
    fingerprint = hashlib.sha256(
        f"{traffic.fingerprint('train', cfg.traffic.heldout_fraction)}|{train_dir.name}|{d.responses_per_prompt}"
            .encode()).hexdigest()[:16]
    return TrainingData(train, heldout, token_ids, fingerprint)


def run_distill(cfg: DraftopsConfig, *, init_only: bool = False) -> DistillResult:
    """The whole job. Every process runs it (under `accelerate launch`); only the main one exports and registers.

    init_only: stop after initializing the draft and export it untrained to `<job>/init` (the "undistilled" baseline
    of a benchmark); nothing is trained or registered.
    """
    from accelerate.utils import set_seed

    from distill.export import export_draft, log_and_register
    from decode.runtime import load_model

    timings = Timings()
    accelerator = make_accelerator(cfg)
    with timings.measure("load_target"):
        target = load_model(cfg.target, device=accelerator.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    data = prepare_data(cfg, accelerator, target, timings)
    job_dir = Path(cfg.distill.output_dir) / job_key(cfg, data.fingerprint)
    set_seed(cfg.seed)
    # fp32 master weights even beside a bf16 target; accelerate's mixed precision casts the compute
    draft = init_draft(cfg.distill, target.model, token_ids=data.token_ids).float()
    if init_only:
        export_dir = job_dir / "init"
        if accelerator.is_main_process:
            export_draft(draft.eval(), target.tokenizer, export_dir, token_ids=data.token_ids, cfg=cfg)
            print(f"draftops distill: untrained draft ({cfg.distill.init}) exported to {export_dir}; "
                  "nothing trained or registered")
        return DistillResult(export_dir, job_dir, {}, [], [], timings.seconds, data.token_ids, data.fingerprint)
    embeddings = draft.get_input_embeddings().weight
    if draft.get_output_embeddings().weight is not embeddings:  # a tied head is trained, and its embeddings with it
        embeddings.requires_grad_(cfg.distill.train_embeddings)
    accelerator.print(f"draftops distill: draft of {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters "
                      f"({sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.1f}M trained), "
                      f"lm_head over {draft.lm_head.out_features} ids; {accelerator.num_processes} process(es) on "
                      f"{accelerator.device}; job folder {job_dir}")
    history, evals, best = train_loop(cfg, accelerator, target.model, target.tokenizer, draft, data, job_dir, timings)
    accelerator.wait_for_everyone()

    export_dir = job_dir / "draft"
    result = DistillResult(export_dir, job_dir, {}, history, evals, timings.seconds, data.token_ids, data.fingerprint)
    if accelerator.is_main_process:
        draft = load_best(cfg, target.model, data.token_ids, job_dir / "best")
        with timings.measure("eval"):
            exact = exact_eval(target.model, draft, data.heldout, data.token_ids, cfg.decode.gamma)
        select = "tau_t0" if cfg.decode.temperature == 0 else "tau_t1"
        result.metrics = {**exact, "tau": exact[select], "best_step": best["step"],
                          "loss": history[best["step"] - 1]["loss"],
                          "train_responses": len(data.train), "train_tokens": data.train.num_response_tokens}
        with timings.measure("export"):
            export_draft(draft, target.tokenizer, export_dir, token_ids=data.token_ids, cfg=cfg)
            point_latest(Path(cfg.distill.output_dir) / "latest", export_dir)
        if cfg.distill.register_model:
            with timings.measure("register"):
                result.run_id, result.version, result.alias = log_and_register(
                    cfg, result, target_fingerprint=target.fingerprint, target_source=cfg.target)
        (job_dir / "result.json").write_text(json.dumps(
            {"metrics": result.metrics, "history": history, "evals": evals, "timings": result.timings,
             "export_dir": str(export_dir), "run_id": result.run_id, "version": result.version,
             "alias": result.alias}, indent=1))
        print_summary(cfg, result)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down cleanly (gloo ranks abort at exit otherwise)
    return result


def point_latest(link: Path, export_dir: Path) -> None:
    """`<output_dir>/latest` → the last exported draft (a relative symlink, replaced atomically)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(export_dir, link.parent))
    os.replace(tmp, link)


def print_summary(cfg: DraftopsConfig, result: DistillResult) -> None:
    from pipeline.tracking import tracking_uri

    m = result.metrics
    print("\ndraftops distill: done")
    print(f"  best step {m['best_step']}: α(T=0) {m['alpha_t0']:.3f}  α(T=1) {m['alpha_t1']:.3f}  "
          f"τ(γ={cfg.decode.gamma}) T=0 {m['tau_t0']:.2f}, T=1 {m['tau_t1']:.2f}")
    print("  time: " + "  ".join(f"{k} {v:.0f}s" for k, v in result.timings.items())
          + f"  (total {sum(result.timings.values()):.0f}s)")
    print(f"  draft:        {result.export_dir}  (also {Path(cfg.distill.output_dir) / 'latest'})")
    if (result.export_dir / HF_ASSISTANT_DIR).exists():
        print(f"  HF assistant: {result.export_dir / HF_ASSISTANT_DIR}")
    if result.version:
        print(f"  MLflow:       {tracking_uri(cfg)}  run {result.run_id}  (experiment draftops-distill)")
        print(f"  registered:   models:/{cfg.tracking.registered_model}/{result.version}  alias {result.alias}")


def main(argv: list[str] | None = None) -> int:
    """`python -m distill.train --config FILE [key=value ...]` (what `accelerate launch -m distill.train` runs)."""
    import argparse

    from pipeline.config import load_config

    parser = argparse.ArgumentParser(prog="distill.train")
    parser.add_argument("--config", default=None)
    parser.add_argument("--init-only", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        run_distill(load_config(args.config, args.overrides), init_only=args.init_only)
    except NonFiniteLoss as exc:
        print(f"draftops distill: error: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
