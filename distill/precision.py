"""The precisions a distill job computes in on a CPU: `distill.generation_dtype: auto` (whether the target generates
the training responses faster in bf16) and `distill.mixed_precision: auto` (whether the draft trains faster in bf16
mixed precision), each chosen by timing both candidates on this machine. A CPU without bf16 units (`bf16_units`) times
nothing: fp32. It is a client of `decode.runtime.machine_choice`, which caches the timings; both choices decide what
the job produces, so both are cached from their first timing even on a busy machine (`pins_output`).
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from decode.models.feature_draft import FeatureDraft
from decode.runtime.kernels import Shape, linear_shapes, onednn_linear, streamed_weights
from decode.runtime.machine_choice import bf16_units, interleaved_minimums, measured, measured_once

GENERATION, TRAINING = "generation_dtype", "mixed_precision"  # the choices' names in `machine_choice`
LENGTH_STEP = 64  # the timed sequence length: the job's mean length rounded up to this, so similar jobs share a file
FP32_ATTENTION = "draftops_sdpa_fp32"  # transformers' attention implementation `fp32_attention` registers


def _sdpa_in_fp32(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention with autocast off and q, k, v in fp32 -> (output in q's dtype, None)."""
    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(dtype), weights


AttentionInterface.register(FP32_ATTENTION, _sdpa_in_fp32)


@contextmanager
def fp32_attention(model: torch.nn.Module, on: bool = True) -> Iterator[torch.nn.Module]:
    """For the duration (if `on`), `model`'s attention runs in fp32 under bf16 autocast: torch's bf16 attention on a
    CPU, its backward above all, costs more than fp32's (docs/results.md#the-cpu-runtime), while the products keep
    autocast's bf16. Only where the model runs transformers'
    sdpa attention; its setting is restored after."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if not on or previous != "sdpa":
        yield model
        return
    config._attn_implementation = FP32_ATTENTION
    try:
        yield model
    finally:
        config._attn_implementation = previous


def step_scope(draft: torch.nn.Module, rows: int, length: int) -> dict:
    """What the timing of a training step depends on besides the machine: the draft's config and parameters trained,
    and the step's rows and length."""
    config = draft.config.to_json_string(use_diff=False) if hasattr(draft, "config") else type(draft).__name__
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return {"rows": rows, "length": length,
            "draft": hashlib.sha256(f"{config}|{trained}".encode()).hexdigest()[:12]}


def time_steps(step_logits: torch.nn.Module, vocab: int, *, rows: int, length: int) -> tuple[float, float]:
    """(fp32 s, bf16 s): the fastest of interleaved training steps (forward, cross-entropy in fp32, backward) of
    `step_logits` (a `distill.step.ResponseLogits`, or a `FeatureStepLogits` fed random features) on random ids, every
    position scored. The gradients are cleared after each step and the global random state is left as it was."""
    parameters = [p for p in step_logits.parameters() if p.requires_grad]
    draft = step_logits.draft
    with torch.random.fork_rng():
        torch.manual_seed(0)
        input_ids = torch.randint(0, draft.config.vocab_size, (rows, length))
        labels = torch.randint(0, vocab, (rows * length,))
        features = ({"features": torch.randn(rows, length, draft.fc.in_features)}
                    if isinstance(draft, FeatureDraft) else {})
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    loss_mask = torch.ones(rows, length, dtype=torch.bool)

    def step(bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), fp32_attention(draft, bf16):
            logits = step_logits(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, **features)
        per_step = logits if isinstance(logits, list) else [logits]  # a feature draft: one per unrolled step
        sum(F.cross_entropy(s.float(), labels[: len(s)]) for s in per_step).backward()
        for p in parameters:
            p.grad = None

    was_training = step_logits.training
    step_logits.train()
    try:
        fp32_s, bf16_s = interleaved_minimums([lambda: step(False), lambda: step(True)], reps=3, min_reps=3)
    finally:
        step_logits.train(was_training)
    return fp32_s, bf16_s


def step_timings(step_logits: torch.nn.Module, vocab: int, *, rows: int, length: int) -> tuple[float, float]:
    """(fp32 s, bf16 s) of a training step (`time_steps`), timed once per machine and step (`step_scope`)."""
    fp32_s, bf16_s = measured_once(
        TRAINING, step_scope(step_logits.draft, rows, length),
        lambda: [round(s, 5) for s in time_steps(step_logits, vocab, rows=rows, length=length)], pins_output=True)
    return float(fp32_s), float(bf16_s)


def mixed_precision_choice(setting: str, step_logits: torch.nn.Module, vocab: int, *, device: torch.device,
                           rows: int, mean_length: float) -> str:
    """The mixed precision to train in: `setting` unless it is "auto"; then "bf16" on a CPU with bf16 units where a
    training step of `rows` rows of about `mean_length` tokens measures faster with it (`step_timings`), else "no".
    Whether it pays depends on the CPU and the model's size, not on one instruction set: the casts autocast adds can
    cost as much as the products save. Off the CPU, `auto` trains in full precision."""
    if setting != "auto":
        return setting
    if device.type != "cpu" or not bf16_units():
        return "no"
    length = max(LENGTH_STEP, -(-int(mean_length) // LENGTH_STEP) * LENGTH_STEP)
    fp32_s, bf16_s = step_timings(step_logits, vocab, rows=rows, length=length)
    return "bf16" if bf16_s < fp32_s else "no"


def measure_shape(shape: Shape, rows: int) -> tuple[float, float]:
    """(fp32 ms, bf16 ms) of one product of `rows` rows with a weight of `shape`: fp32 the faster of F.linear and
    oneDNN on a packed weight, each call on the next of the `streamed_weights`, the fastest of interleaved calls."""
    weights, packed = streamed_weights(shape)
    halves = [w.bfloat16() for w in weights]
    x = torch.randn(rows, shape[1])
    x16 = x.bfloat16()
    plain, blocked, bf16 = itertools.cycle(weights), itertools.cycle(zip(weights, packed)), itertools.cycle(halves)

    def onednn_call():
        weight, packed_weight = next(blocked)
        return onednn_linear(x, weight, None, packed_weight)

    with torch.inference_mode():
        torch_s, onednn_s, bf16_s = interleaved_minimums(
            [lambda: F.linear(x, next(plain)), onednn_call, lambda: F.linear(x16, next(bf16))])
    return round(min(torch_s, onednn_s) * 1e3, 4), round(bf16_s * 1e3, 4)


def shape_timings(shapes: list[Shape], rows: int) -> dict[Shape, tuple[float, float]]:
    """(fp32 ms, bf16 ms) per shape at `rows` (`measure_shape`), timed once per machine and row count."""
    names = {shape: f"{shape[0]}x{shape[1]}" for shape in shapes}

    def measure_named(name: str) -> tuple[float, float]:
        out_features, in_features = (int(n) for n in name.split("x"))
        return measure_shape((out_features, in_features), rows)

    timings = measured(GENERATION, {"rows": rows}, list(names.values()), measure_named,
                       parse=lambda t: (float(t[0]), float(t[1])), pins_output=True)
    return {shape: timings[name] for shape, name in names.items()}


def step_costs(model: torch.nn.Module, rows: int) -> tuple[float, float]:
    """(fp32 ms, bf16 ms) of the products of one step of `rows` rows through every linear layer of `model`."""
    counts = linear_shapes(model)
    timings = shape_timings(sorted(counts), rows)
    return (sum(counts[s] * timings[s][0] for s in counts), sum(counts[s] * timings[s][1] for s in counts))


def generation_dtype(model: torch.nn.Module, rows: int) -> torch.dtype:
    """The dtype the target should generate in: bfloat16 for an fp32 CPU model on a CPU with bf16 units where its
    step of `rows` rows measures faster in bfloat16 (`step_costs`), else the model's own. A generation step's
    products have as many rows as the generation batch, and whether bf16 is faster for this model's shapes depends on
    the CPU and torch's kernels, so each shape is timed against the fp32 kernel `cpu_linear: auto` would run."""
    dtype = next(model.parameters()).dtype
    if next(model.parameters()).device.type != "cpu" or dtype != torch.float32 or not bf16_units():
        return dtype
    fp32_ms, bf16_ms = step_costs(model, rows)
    return torch.bfloat16 if bf16_ms < fp32_ms else dtype
