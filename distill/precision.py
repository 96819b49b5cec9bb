"""Whether the draft trains faster in bf16 mixed precision on this CPU (`distill.mixed_precision: auto`): one training
step of the job's draft timed both ways, once per CPU and draft shape, and cached like `distill.generation_dtype: auto`.

torch's CPU autocast runs the products in bf16 and keeps the weights, the optimizer and the loss in fp32. Whether
that pays depends on the CPU and on the model's size, not on one instruction set: with AVX512_BF16 an AMD Zen 4
trained the default draft 1.4x faster, while an Intel Xeon with AMX, whose bf16 tiles are faster still, measured
0.96x (at this size the casts autocast adds cost as much as the products save). So the step is measured: the draft's
forward, a loss in fp32 and the backward, on `batch_size` rows of the job's typical length, fp32 and bf16 in turns,
the fastest of each (`decode.runtime.timing.interleaved_minimums`). A CPU without bf16 units is not measured. In bf16
the attention stays fp32 (`fp32_attention`), as in generation: torch's bf16 attention on a CPU is the slower one.

The timings are cached as JSON under `$DRAFTOPS_HOME/mixed_precision/`, one file per machine key and step shape;
timings taken on a busy machine are cached too, with a warning: the precision decides the draft's arithmetic, and a
killed job's re-run must train on as the first run did. On any other device `auto` trains in full precision.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from decode.runtime.kernel_choice import BusyMachineWarning, machine_busy, machine_key
from decode.runtime.precision_choice import bf16_units
from decode.runtime.timing import interleaved_minimums
from pipeline import draftops_home
from pipeline.files import write_text_atomic

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
    CPU, its backward above all, costs more than fp32's (a training step of the default draft: 2 x 50 ms in the
    backward against 2 x 21 ms), while the products keep autocast's bf16. Only where the model runs transformers'
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


def cache_file(key: dict, signature: str) -> Path:
    """$DRAFTOPS_HOME/mixed_precision/<cpu>_torch-<version>_<threads>-threads_<signature>.json"""
    name = f"{key['cpu']}_torch-{key['torch']}_{key['threads']}-threads_{signature}"
    return draftops_home() / "mixed_precision" / (re.sub(r"[^A-Za-z0-9.+_-]+", "-", name) + ".json")


def step_signature(draft: torch.nn.Module, rows: int, length: int) -> str:
    """What the timing of a step depends on besides the machine: the draft's config and parameters trained, and
    the step's rows and length."""
    config = draft.config.to_json_string(use_diff=False) if hasattr(draft, "config") else type(draft).__name__
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    digest = hashlib.sha256(f"{config}|{trained}".encode()).hexdigest()[:12]
    return f"{rows}x{length}_{digest}"


def time_steps(step_logits: torch.nn.Module, vocab: int, *, rows: int, length: int) -> tuple[float, float]:
    """(fp32 s, bf16 s): the fastest of interleaved training steps (forward, cross-entropy in fp32, backward) of
    `step_logits` (a `distill.step.ResponseLogits`) on random ids, every position scored. The gradients are cleared
    after each step and the global random state is left as it was."""
    parameters = [p for p in step_logits.parameters() if p.requires_grad]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        input_ids = torch.randint(0, step_logits.draft.config.vocab_size, (rows, length))
        labels = torch.randint(0, vocab, (rows * length,))
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    loss_mask = torch.ones(rows, length, dtype=torch.bool)

    def step(bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), fp32_attention(step_logits.draft, bf16):
            logits = step_logits(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
        F.cross_entropy(logits.float(), labels).backward()
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
    """(fp32 s, bf16 s) of a training step: from this machine's cache file, else measured (`time_steps`) and
    cached, with a warning when the machine was busy."""
    key = machine_key()
    path = cache_file(key, step_signature(step_logits.draft, rows, length))
    try:
        data = json.loads(path.read_text())
        if data["key"] == key:
            return float(data["fp32_s"]), float(data["bf16_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fp32_s, bf16_s = time_steps(step_logits, vocab, rows=rows, length=length)
    busy = machine_busy()
    if busy:  # cached all the same: a killed job's re-run must train in the precision the first run chose
        warnings.warn(f"mixed_precision auto: timed on a busy machine ({busy}); cached in {path} all the same (a "
                      "killed job's re-run must train as the first run did): delete it to time again",
                      BusyMachineWarning, stacklevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"key": key, "rows": rows, "length": length, "fp32_s": round(fp32_s, 5),
                                        "bf16_s": round(bf16_s, 5)}, indent=1))
    return fp32_s, bf16_s


def mixed_precision_choice(setting: str, step_logits: torch.nn.Module, vocab: int, *, device: torch.device,
                           rows: int, mean_length: float) -> str:
    """The mixed precision to train in: `setting` unless it is "auto"; then "bf16" on a CPU with bf16 units where a
    training step of `rows` rows of about `mean_length` tokens measures faster with it (`step_timings`), else "no"."""
    if setting != "auto":
        return setting
    if device.type != "cpu" or not bf16_units():
        return "no"
    length = max(LENGTH_STEP, -(-int(mean_length) // LENGTH_STEP) * LENGTH_STEP)
    fp32_s, bf16_s = step_timings(step_logits, vocab, rows=rows, length=length)
    return "bf16" if bf16_s < fp32_s else "no"
