"""The peer, run here: vLLM's `speculators` trains its EAGLE-3 head on draftops' cached data for the default job, the
head comes back through `draftops models import`, and draftops' held-out evaluation measures it beside draftops'
own drafts (`--evaluate`).

    PYTHONPATH=$PWD DRAFTOPS_HOME=/work/home nice -n 19 python benchmarks/peer_speculators.py \\
        --out outputs/peer --tracking-uri sqlite:////abs/path/peer.db
    PYTHONPATH=$PWD DRAFTOPS_HOME=/work/home nice -n 19 python benchmarks/peer_speculators.py \\
        --out outputs/peer --evaluate LAYER_DRAFT_DIR FEATURE_DRAFT_DIR outputs/peer/imported

What is the same as draftops' default job (configs/default.yaml): the target (SmolLM2-135M-Instruct, float32), the
training responses and their order (the response cache of `make distill`, read through `distill.train.prepare_data`;
each optimizer step takes the 16 sequences that draftops' step of that number takes, `distill.data.batches`), the number
of optimizer steps (3 epochs), the draft vocabulary size (8,192), the three target layers read (2, 15, 27) and their
features (draftops' feature cache, which `draftops distill distill.family=features` writes, or computed here the same
way), the unrolled steps (3) and float32 compute (draftops trains feature drafts in full precision on a CPU).

Why not speculators' `Trainer`: it falls back to device type "cuda" when torch has no accelerator
(`Trainer.__init__`: `acc.type if acc is not None else "cuda"`), moves every batch to `self.local_rank` (a device
index) and autocasts on that device type, and its data loader reads hidden states it generates through a vLLM server
or from files of its own layout. So this script uses its model class (`Eagle3DraftModel.from_training_args` over the
layer config its CLI builds, `draft_layer_config`), its vocabulary mapping from the response tokens'
frequencies (`build_vocab_mappings_from_distribution`), its packing of several documents into one row
(`CollateFn`, `shift_batch`: document masks, positions from 1), its loss (the forward's training-time test: KL from
the verifier's logits over the draft vocabulary, 3 steps, no decay; its eager implementation, as the fused one needs
Triton) and its documented defaults for what it trains with (`train/config/schema.py`: Muon on the 2-D matrices plus
AdamW, lr 1e-3, weight decay 0.01 / 0.1 (Muon), linear schedule with 1% warmup, gradient norm clipped at 1.0,
`norm_before_residual` true, frozen embeddings and head), under a minimal loop. Three settings differ from its
defaults, each for the CPU and said here: Muon's Newton–Schulz iterations in float32 where the CPU has no bf16 units
(`distill.optimizers.newton_schulz_in_fp32`), attention "sdpa" (its default flex attention compiles kernels for a GPU)
and the draft layer's attention full rather than sliding (the documents are shorter than its 2,048-token window, and
vLLM serves a Llama EAGLE-3 layer without one).

The teacher its loss takes is the verifier's own distribution: its final norm and head rows of the draft vocabulary
applied to the verifier's last hidden state (before its final norm). That state is computed here from draftops'
cached features: the state entering layer 27 (stored in float16) run through the target's layers 27 to 29.

What differs from draftops' feature draft, so what a gap measures: the start (a random decoder layer and the
verifier's head rows, the head frozen; draftops starts the layer from the target's last layer and trains the head),
the loss (KL from the full distribution over the draft vocabulary; draftops: forward KL from the cached top-64), the
optimizer and schedule (Muon + AdamW at 1e-3, linear; draftops: AdamW at 3e-3, cosine to 10%), the residual
(`norm_before_residual`), and the packing (one row of 16 documents; draftops: 16 padded rows).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from accelerate import PartialState

from decode.chain_acceptance import ENGINE_CHAIN, chain_text
from decode.models.feature_draft import FeatureDraft
from decode.serving.draft_import import import_head, register_import
from decode.serving.loading import load_draft, load_model
from distill.data.batches import global_batch_indices
from distill.heldout_eval import exact_eval, feature_eval
from distill.init import feature_layers
from distill.loop import global_batch_and_steps
from distill.optimizers import newton_schulz_in_fp32
from distill.step import FeatureStepLogits
from distill.timings import Timings
from distill.train import prepare_data
from pipeline.config import load_config
from pipeline.sources import locate


def job_config(args, family: str = "features"):
    """The default job as `draftops distill` reads it, as a feature draft job (so its data carries the features; for
    evaluating only, as the layer job: the held-out responses are the same), at the layer draft's batch and epochs
    (16 × 3: 528 steps), as the peer was first measured."""
    tracking = [f"tracking.uri={args.tracking_uri}"] if args.tracking_uri else []
    overrides = [f"distill.family={family}", "distill.batch_size=16", "distill.epochs=3", "device=cpu", *tracking,
                 *args.overrides]
    return load_config(args.config, overrides)


@torch.inference_mode()
def last_hidden_states(target, features: torch.Tensor, offsets: torch.Tensor, first: int, hidden: int,
                       batch_size: int = 16) -> torch.Tensor:
    """[Σ len, H] float16: the target's last hidden state (before its final norm) at every position, from the cached
    state entering layer `first` (the features' last H columns) through the target's layers from `first` on."""
    model = copy.copy(target.model)
    model._modules = dict(target.model._modules)  # a shallow copy shares its modules' dict: leave the target whole
    model.layers = target.model.layers[first:]
    model.norm = torch.nn.Identity()
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out = torch.empty(int(offsets[-1]), hidden, dtype=torch.float16)
    for begin in range(0, len(order), batch_size):
        rows = order[begin : begin + batch_size]
        width = max(lengths[i] for i in rows)
        states = torch.zeros(len(rows), width, hidden)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            states[r, : lengths[i]] = features[int(offsets[i]) : int(offsets[i + 1]), -hidden:].float()
            mask[r, : lengths[i]] = 1
        last = model(inputs_embeds=states, attention_mask=mask, use_cache=False).last_hidden_state
        for r, i in enumerate(rows):
            out[int(offsets[i]) : int(offsets[i + 1])] = last[r, : lengths[i]].half()
    return out


def peer_model(verifier: str, train, draft_vocab_size: int, layers: list[int]):
    """speculators' EAGLE-3 head for the verifier folder, its vocabulary mapped from the response tokens'
    frequencies, built as its training CLI builds it."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    layer = draft_layer_config(verifier)
    frequencies = Counter(t for response in train.response_ids for t in response)
    d2t, t2d = build_vocab_mappings_from_distribution(dict(frequencies), draft_vocab_size, layer.vocab_size)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size, norm_before_residual=True,
        ttt_steps=3, verifier_name_or_path=verifier, target_layer_ids=layers, draft_attn_impl="sdpa")


def draft_layer_config(verifier: str):
    """The draft's Llama layer config as speculators' training CLI builds it for a Llama verifier
    (`speculators.train.cli.create_transformer_layer_config`: the verifier's shapes, one layer, SiLU, its rotary
    parameters; that module cannot be imported here: its data-generation client needs `httpx`), its one layer with
    full attention."""
    from speculators.models.utils import resolve_draft_intermediate_size
    from transformers import AutoConfig, LlamaConfig

    verifier_config = AutoConfig.from_pretrained(verifier)
    config = LlamaConfig(
        vocab_size=verifier_config.vocab_size, hidden_size=verifier_config.hidden_size,
        intermediate_size=resolve_draft_intermediate_size(verifier_config), num_hidden_layers=1,
        num_attention_heads=verifier_config.num_attention_heads,
        num_key_value_heads=verifier_config.num_key_value_heads, hidden_act="silu",
        max_position_embeddings=verifier_config.max_position_embeddings,
        initializer_range=verifier_config.initializer_range, rms_norm_eps=verifier_config.rms_norm_eps,
        head_dim=getattr(verifier_config, "head_dim", None), tie_word_embeddings=False,
        layer_types=["full_attention"])
    config.rope_parameters = copy.deepcopy(verifier_config.rope_parameters)
    return config


def packed_batch(train, rows: list[int], last: torch.Tensor, hidden: int):
    """The step's sequences as speculators packs them: one row, documents one after another (`CollateFn` over
    `shift_batch`ed samples: features at i with token i+1, the loss on response tokens)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    samples = []
    for i in rows:
        sequence = train.prompt_ids[i] + train.response_ids[i]
        begin, end = int(train.feature_offsets[i]), int(train.feature_offsets[i + 1])
        loss_mask = torch.zeros(len(sequence), dtype=torch.bool)
        loss_mask[len(train.prompt_ids[i]) :] = True
        samples.append(shift_batch({
            "input_ids": torch.tensor(sequence), "hidden_states": train.features[begin:end].float(),
            "verifier_last_hidden_states": last[begin:end].float(), "loss_mask": loss_mask,
            "lengths": torch.tensor([len(sequence)]), "position_ids": torch.arange(len(sequence))}))
    total = sum(len(s["input_ids"]) for s in samples)
    batch = CollateFn(total, hidden, dtype=torch.float32)(samples)
    batch.pop("error_records", None)
    return batch


def optimizers_and_schedules(model, total_steps: int):
    """speculators' documented optimizer (`build_optimizers` with its schema's defaults) and linear schedule."""
    from types import SimpleNamespace

    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    settings = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.01, muon_lr=1e-3, muon_momentum=0.95,
                               muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw")
    optimizers = build_optimizers(model, settings)
    schedules = [get_linear_schedule_with_warmup(o, total_steps // 100, total_steps) for o in optimizers]
    return optimizers, schedules


def train_peer(cfg, data, target, out: Path, log) -> Path:
    """Train speculators' head for the job's steps on its sequences; its folder (speculators' own save)."""
    d = cfg.distill
    hidden = target.model.config.hidden_size
    layers = list(feature_layers(d, target.model.config.num_hidden_layers))
    verifier = str(locate(cfg.target).path)
    last_file = out / "last_hidden.pt"
    if last_file.exists():
        last = torch.load(last_file, weights_only=True)
    else:
        started = time.perf_counter()
        last = last_hidden_states(target.model, data.train.features, data.train.feature_offsets, layers[-1], hidden)
        torch.save(last, last_file)
        log(f"last hidden states of {len(last)} positions in {time.perf_counter() - started:.0f} s")
    model = peer_model(verifier, data.train, d.draft_vocab_size, layers)
    model.train()
    global_batch, total_steps = global_batch_and_steps(d, len(data.train), 1)
    optimizers, schedules = optimizers_and_schedules(model, total_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    lengths = [len(p) + len(r) for p, r in zip(data.train.prompt_ids, data.train.response_ids)]
    from speculators.losses import resolve_loss_config

    loss_config = resolve_loss_config("kl_div", "eager")  # its default loss; the fused kernel needs Triton
    history, started = [], time.perf_counter()
    for step in range(total_steps):
        rows = global_batch_indices(len(data.train), step, global_batch, cfg.seed, lengths)
        batch = packed_batch(data.train, rows, last, hidden)
        _, loss, metrics = model(**batch, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_config)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        with newton_schulz_in_fp32(torch.device("cpu")):  # as draftops' Muon: bf16 is emulated on some CPUs
            for optimizer, schedule in zip(optimizers, schedules):
                optimizer.step()
                schedule.step()
        history.append({"step": step + 1, "loss": float(loss), "tokens": int(batch["loss_mask"].sum()),
                        **{k: float(v) for k, v in metrics.items() if k.startswith("full_acc") or
                           k.startswith("cond_acc")}})
        if (step + 1) % 25 == 0 or step + 1 == total_steps:
            log(f"step {step + 1}/{total_steps}: loss {float(loss):.4f} "
                f"({(time.perf_counter() - started) / (step + 1):.1f} s/step)")
        if not math.isfinite(float(loss)):
            raise RuntimeError(f"loss {float(loss)} at step {step + 1}")
    (out / "peer_history.json").write_text(json.dumps(history))
    head = out / "speculators_head"
    model.save_pretrained(str(head))
    return head


def evaluate(draft_source: str, target, data, gamma: int) -> dict:
    """draftops' held-out evaluation of a draft folder as `draftops distill` ends a job: `exact_eval` for a layer
    draft, `feature_eval` for a feature draft; α(T=0) with its interval, chains of 3 (`decode.chain_acceptance`)."""
    draft = load_draft(draft_source, target, cpu_linear="torch")
    model = draft.model.float().eval()
    if isinstance(model, FeatureDraft):
        return feature_eval(FeatureStepLogits(model, 3), target.model, data.heldout, model.token_ids, gamma,
                            chain_k=ENGINE_CHAIN)
    return exact_eval(target.model, model, data.heldout, draft.token_ids, gamma, chain_k=ENGINE_CHAIN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", default="outputs/peer")
    parser.add_argument("--tracking-uri", default=None, help="where the imported head is registered")
    parser.add_argument("--evaluate", nargs="*", default=None, metavar="DRAFT",
                        help="only evaluate these draft folders (and the peer's import, if given) on the held-out set")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(f"[peer] {line}", file=sys.stderr, flush=True)

    cfg = job_config(args, "layers" if args.evaluate is not None else "features")
    target = load_model(cfg.target, device="cpu", dtype="float32", cpu_linear=cfg.cpu_linear)
    data = prepare_data(cfg, PartialState(cpu=True), target, Timings())
    if args.evaluate is None:
        head = train_peer(cfg, data, target, out, log)
        imported = import_head(head, target, out / "imported", cfg)
        log("imported: " + "; ".join(imported.checks))
        version, alias = register_import(cfg, imported, target)
        log(f"registered as version {version} ({alias}) at {cfg.tracking.uri}")
        args.evaluate = [str(imported.path)]
    results = {}
    for source in args.evaluate:
        m = evaluate(source, target, data, cfg.decode.gamma)
        results[source] = {k: v for k, v in m.items() if k != "ranks"}
        log(f"{source}: α(T=0) {m['alpha_t0']:.3f} [{m['alpha_t0_low']:.3f}, {m['alpha_t0_high']:.3f}]  "
            f"τ(γ={cfg.decode.gamma}) {m['tau_t0']:.2f}  chains of {chain_text(m['chain'])}")
    (out / "heldout.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
