"""`draftops distill`: one function, `run_distill(cfg)`, that runs the whole job under `accelerate`.

data (target responses + top-k teacher, cached) → draft init (+ reduced vocabulary) → training loop (DDP, gradient
accumulation, mixed precision from accelerate) with resumable checkpoints and held-out α/τ evaluation → export of the
best draft by τ → MLflow run + registered version. Run it directly or through `accelerate launch -m distill.train`.

The parts are in the other distill modules (distill/README.md lists them); this module strings them together.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, is_bf16_available, set_seed

from decode.chain_acceptance import ENGINE_CHAIN, chain_text
from decode.drafters.suffix import SuffixIndex
from decode.models.feature_draft import FEATURES
from decode.serving.loading import load_model
from decode.tree_budget_prediction import TREE_BUDGETS, rank_acceptance
from distill.checkpoints import UnsafeCheckpoint, checkpoint_precision, job_key, load_best, point_latest
from distill.data.prepare import TrainingData, prepare_data
from distill.data.recorded import RecordedMismatch
from distill.heldout_eval import exact_eval, feature_eval
from distill.init import init_draft
from distill.loop import NonFiniteLoss, train_loop
from distill.precision import fp32_attention, mixed_precision_choice
from distill.register import export_draft, log_and_register
from distill.step import draft_module
from distill.timings import Timings
from pipeline.config import DraftopsConfig, load_config
from pipeline.errors import OperatorError
from pipeline.files import write_text_atomic
from pipeline.locks import EXIT_BUSY, ModelBusy
from pipeline.metrics import size_alias
from pipeline.registry import set_alias, version_of_job, version_uri
from pipeline.sources import HF_ASSISTANT_DIR, SourceError
from pipeline.tracking import TrackingUnavailable, check_tracking, setup_mlflow, tracking_uri


@dataclass
class DistillResult:
    """What a job produced: where the draft went, its final metrics, the training curves and the registry entry."""

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
    teacher: str = ""  # what generated the training responses and their top-k (`TrainingData.teacher`)
    mixed_precision: str = ""  # what the draft trained in ("no", "bf16", "fp16"): `distill.mixed_precision` resolved


def on_cpu(cfg: DraftopsConfig) -> bool:
    """Whether the job runs on the CPU: asked for, or "auto" finding no accelerator."""
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.accelerator.is_available())


def make_accelerator(cfg: DraftopsConfig, mixed: str) -> Accelerator:
    """CPU (gloo) when `on_cpu`; `mixed` precision ("no", "bf16", "fp16": `distill.precision` resolves "auto") only
    where it is available."""
    # cpu=True also when "auto" finds no accelerator: under torchrun that is what makes the ranks form a gloo group.
    cpu = on_cpu(cfg)
    usable = {"no": True, "fp16": not cpu, "bf16": is_bf16_available()}[mixed]
    if not usable:
        print(f"draftops distill: mixed_precision={mixed} is not available here; training in full precision")
    one_process = PartialState._shared_state.get("distributed_type") == DistributedType.NO
    if AcceleratorState._shared_state and one_process:
        # a later job in this process (a size family, the monitor's retraining) whose timed precision may differ:
        # accelerate keeps one state per process and refuses another precision, so this job's starts afresh
        AcceleratorState._reset_state()
    return Accelerator(cpu=cpu, mixed_precision=mixed if usable else "no")


def training_precision(cfg: DraftopsConfig, state: PartialState, draft, data: TrainingData,
                       job_dir: Path | None = None) -> str:
    """`distill.mixed_precision`, "auto" resolved by timing a step of this draft on this CPU (`distill.precision`;
    the main process measures first, the others read its cache), for either family; a job resumed from a checkpoint
    goes on in the precision it recorded."""
    d = cfg.distill
    if d.mixed_precision != "auto":
        return d.mixed_precision
    # timed and cached per thread count: a job resumed under other conditions could time the other way
    resumed = checkpoint_precision(job_dir) if d.resume and job_dir is not None else None
    if resumed is not None:
        return resumed
    lengths = [len(p) + len(r) for p, r in zip(data.train.prompt_ids, data.train.response_ids)]
    with state.main_process_first():
        return mixed_precision_choice("auto", draft_module(d, draft), draft.lm_head.out_features,
                                      device=state.device, rows=d.batch_size,
                                      mean_length=sum(lengths) / len(lengths))


def distributed_as(accelerator: Accelerator) -> str:
    """", distributed as FSDP" (DDP's "MULTI_GPU", gloo's "MULTI_CPU", ...); "" for one plain process."""
    kind = accelerator.distributed_type
    return "" if kind == DistributedType.NO else f", distributed as {kind.value}"




RESULT_FILE = "result.json"  # in the job folder: written when the draft is exported, again when it is registered


class NothingToRegister(RuntimeError):
    """`--register-only` for a job that has not finished."""


def finished_job(job_dir: Path, data) -> DistillResult | None:
    """The result of a job that ran to its export, or None."""
    path = job_dir / RESULT_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    export_dir = Path(saved["export_dir"])
    if not (export_dir / "config.json").exists():
        return None
    return DistillResult(export_dir, job_dir, saved["metrics"], saved["history"], saved["evals"], saved["timings"],
                         data.token_ids, data.fingerprint, saved["run_id"], saved["version"], saved["alias"],
                         saved.get("teacher", data.teacher), saved.get("mixed_precision", ""))


def save_result(result: DistillResult) -> None:
    write_text_atomic(result.job_dir / RESULT_FILE, json.dumps(
        {"metrics": result.metrics, "history": result.history, "evals": result.evals, "timings": result.timings,
         "export_dir": str(result.export_dir), "run_id": result.run_id, "version": result.version,
         "alias": result.alias, "teacher": result.teacher, "mixed_precision": result.mixed_precision}, indent=1))


def register_once(cfg: DraftopsConfig, result: DistillResult, target, alias: str | None = None) -> DistillResult:
    """Register a finished job's draft unless it already is (a re-run registers nothing twice); `alias` (a size
    family's `layers-N`) is pointed at its version either way. Registered means in the configured registry: a job
    registered in another tracking store (a local sqlite file, then a tracking server) is registered here too."""
    setup_mlflow(cfg)
    found = version_of_job(cfg.tracking.registered_model, result.job_dir.name)
    # a version without a saved result is a registration cut short (killed before its alias): finish it below
    if found is not None and result.version is not None:
        result.version, result.run_id = str(found.version), found.run_id
        if alias is not None:
            set_alias(cfg.tracking.registered_model, alias, result.version, lock_timeout=cfg.tracking.lock_timeout)
            result.alias = alias
        return result
    result.run_id, result.version, result.alias = log_and_register(
        cfg, result, target_fingerprint=target.fingerprint, target_source=cfg.target, alias=alias)
    save_result(result)
    return result


def run_distill(cfg: DraftopsConfig, *, init_only: bool = False, register_only: bool = False,
                alias: str | None = None) -> DistillResult:
    """The whole job. Every process runs it (under `accelerate launch`); only the main one exports and registers.

    A job that already ran to its export (same config and data: the same job folder) is not trained again: its draft
    is registered if it is not yet, once. init_only: stop after initializing the draft and export it untrained to
    `<job>/init` (the "undistilled" baseline of a benchmark); nothing is trained or registered. register_only: only
    that last step; an error when the job has not finished. alias: registered with this alias instead of
    champion/challenger (`run_sizes`).
    """
    if cfg.distill.register_model and not init_only:
        check_tracking(cfg)  # before the work, not at registration after it
    timings = Timings()
    # the Accelerator comes once the draft exists: "auto" mixed precision is timed on it (`training_precision`)
    state = PartialState(cpu=on_cpu(cfg))
    with timings.measure("load_target"):
        target = load_model(cfg.target, device=state.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    data = prepare_data(cfg, state, target, timings)
    job_dir = Path(cfg.distill.output_dir) / job_key(cfg, data.fingerprint)
    finished = None if init_only else finished_job(job_dir, data)
    if register_only and finished is None:
        raise NothingToRegister(f"no finished distill job for this config in {job_dir}: nothing to register")
    if finished is not None:
        return conclude_finished(cfg, state, target, finished, alias)
    set_seed(cfg.seed)
    draft = init_draft(cfg.distill, target.model, token_ids=data.token_ids, tokenizer=target.tokenizer)
    if init_only:
        return export_untrained(cfg, state, target, draft, data, job_dir, timings)
    accelerator, history, evals, best = train(cfg, state, target, draft, data, job_dir, timings)
    result = DistillResult(job_dir / "draft", job_dir, {}, history, evals, timings.seconds, data.token_ids,
                           data.fingerprint, teacher=data.teacher, mixed_precision=accelerator.mixed_precision)
    if accelerator.is_main_process:
        export_best(cfg, target, data, result, best, timings)
        if cfg.distill.register_model:
            with timings.measure("register"):
                register_once(cfg, result, target, alias)
        print_summary(cfg, result)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down cleanly (gloo ranks abort at exit otherwise)
    return result


def conclude_finished(cfg: DraftopsConfig, state: PartialState, target, finished: DistillResult,
                      alias: str | None) -> DistillResult:
    """A job that had run to its export: its draft registered (once), nothing trained again."""
    if state.is_main_process:
        if cfg.distill.register_model:
            register_once(cfg, finished, target, alias)
        print(f"draftops distill: {finished.job_dir} had finished; nothing trained again")
        print_summary(cfg, finished)
    state.wait_for_everyone()
    state.destroy_process_group()
    return finished


def export_untrained(cfg: DraftopsConfig, state: PartialState, target, draft, data: TrainingData, job_dir: Path,
                     timings: Timings) -> DistillResult:
    """`--init-only`: the initialized draft exported to `<job>/init`, nothing trained or registered."""
    export_dir = job_dir / "init"
    if state.is_main_process:
        export_draft(draft.eval(), target.tokenizer, export_dir, token_ids=data.token_ids, cfg=cfg)
        print(f"draftops distill: untrained draft ({cfg.distill.init}) exported to {export_dir}; "
              "nothing trained or registered")
    return DistillResult(export_dir, job_dir, {}, [], [], timings.seconds, data.token_ids, data.fingerprint)


def train(cfg: DraftopsConfig, state: PartialState, target, draft, data: TrainingData, job_dir: Path,
          timings: Timings) -> tuple[Accelerator, list[dict], list[dict], dict]:
    """The training loop in the resolved precision -> (the accelerator, history, evaluations, best evaluation)."""
    embeddings = draft.get_input_embeddings().weight
    if draft.get_output_embeddings().weight is not embeddings and cfg.distill.family != FEATURES:
        # a tied head is trained, and its embeddings with it; a feature draft's embeddings are the target's
        embeddings.requires_grad_(cfg.distill.train_embeddings)
    if not cfg.distill.train_head:
        if draft.get_output_embeddings().weight is embeddings:
            raise ValueError("distill.train_head=false: this draft's head is tied to its embeddings")
        draft.get_output_embeddings().weight.requires_grad_(False)
    accelerator = make_accelerator(cfg, training_precision(cfg, state, draft, data, job_dir))
    mixed = accelerator.mixed_precision
    accelerator.print(f"draftops distill: draft of {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters "
                      f"({sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.1f}M trained), "
                      f"lm_head over {draft.lm_head.out_features} ids; {accelerator.num_processes} process(es) on "
                      f"{accelerator.device}{distributed_as(accelerator)}, "
                      f"{'full precision' if mixed == 'no' else mixed + ' mixed precision'}"
                      f"{' (auto: timed on this CPU)' if cfg.distill.mixed_precision == 'auto' else ''}; "
                      f"job folder {job_dir}")
    with fp32_attention(draft, on=mixed == "bf16" and accelerator.device.type == "cpu"):  # as it was timed
        history, evals, best = train_loop(cfg, accelerator, target.model, target.tokenizer, draft, data, job_dir,
                                          timings)
    accelerator.wait_for_everyone()
    return accelerator, history, evals, best


def export_best(cfg: DraftopsConfig, target, data: TrainingData, result: DistillResult, best: dict,
                timings: Timings) -> None:
    """The best weights by τ evaluated exactly (the target alongside) into `result.metrics`, exported to
    `result.export_dir` with the draft's suffix index and rank acceptance, and the result saved: the job has
    finished."""
    draft = load_best(cfg, target.model, data.token_ids, result.job_dir / "best")
    with timings.measure("eval"):
        if cfg.distill.family == FEATURES:  # exact at T=0 already: the target gives the features
            exact = feature_eval(draft_module(cfg.distill, draft), target.model, data.heldout, data.token_ids,
                                 cfg.decode.gamma, with_ranks=True, chain_k=ENGINE_CHAIN)
        else:
            exact = exact_eval(target.model, draft, data.heldout, data.token_ids, cfg.decode.gamma, with_ranks=True,
                               by_turn=data.by_turn)
        ranks = exact.pop("ranks")
    select = "tau_t0" if cfg.decode.temperature == 0 else "tau_t1"
    result.metrics = {**exact, "tau": exact[select], "best_step": best["step"],
                      "loss": result.history[best["step"] - 1]["loss"],
                      "train_responses": len(data.train), "train_tokens": data.train.num_response_tokens,
                      **({"train_turns": data.train_turns} if data.by_turn else {})}
    with timings.measure("export"):
        # the draft travels with a suffix index of the target's train responses (`decode.drafters.suffix`)
        # ... and the rank acceptance its token trees' node budget is chosen from (`decode.tree_budget_measured`)
        export_draft(draft, target.tokenizer, result.export_dir, token_ids=data.token_ids, cfg=cfg,
                     suffix_index=SuffixIndex(data.train.response_ids),
                     rank_acceptance=(rank_acceptance(ranks, max(TREE_BUDGETS)), sum(map(len, ranks))))
        point_latest(Path(cfg.distill.output_dir) / "latest", result.export_dir)
    save_result(result)  # finished: a re-run after a failed registration only registers


def sizes_config(cfg: DraftopsConfig, layers: int) -> DraftopsConfig:
    """The job of the family member with `layers` decoder layers: the target's first `layers` layers, everything else
    (data, vocabulary, objective, budget) as in `cfg`."""
    if cfg.distill.family != "layers" or cfg.distill.init != "target_layers":
        raise ValueError("--sizes distills drafts made of the target's first N layers: it needs distill.family=layers "
                         f"and distill.init=target_layers (got {cfg.distill.family}, {cfg.distill.init})")
    if layers < 1:
        raise ValueError(f"--sizes: a draft has at least 1 layer (got {layers})")
    return cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"init_layers": list(range(layers))})})


def run_sizes(cfg: DraftopsConfig, sizes: list[int]) -> list[DistillResult]:
    """A family of drafts at one budget: one job per size (`sizes_config`), each registered with the alias
    `layers-N` (`pipeline.metrics.size_alias`) for `draftops sweep` to compare; finished jobs are not trained again."""
    results = []
    for layers in sizes:
        if PartialState().is_main_process:
            print(f"draftops distill: family member of {layers} layer(s) ({len(results) + 1} of {len(sizes)})")
        results.append(run_distill(sizes_config(cfg, layers), alias=size_alias(layers)))
    if results and results[0].metrics:
        print("\ndraftops distill: the family, one budget")
        print("  layers  α(T=0)  τ    training s  version")
        for layers, r in zip(sizes, results):
            print(f"  {layers:>6}  {r.metrics['alpha_t0']:.3f}  {r.metrics['tau']:.2f}  "
                  f"{r.timings.get('training', 0.0):>10.0f}  {r.version or '-'} {r.alias or ''}")
        print("  compare them: make sweep (draftops sweep --drafts 'models:/NAME@layers-N,...')")
    return results


def print_summary(cfg: DraftopsConfig, result: DistillResult) -> None:
    m = result.metrics
    print("\ndraftops distill: done")
    interval = (f" [{m['alpha_t0_low']:.3f}, {m['alpha_t0_high']:.3f}]" if "alpha_t0_low" in m else "")
    print(f"  best step {m['best_step']}: α(T=0) {m['alpha_t0']:.3f}{interval}  α(T=1) {m['alpha_t1']:.3f}  "
          f"τ(γ={cfg.decode.gamma}) T=0 {m['tau_t0']:.2f}, T=1 {m['tau_t1']:.2f}"
          + ("  (95% intervals over the held-out prompts)" if interval else ""))
    by_turn = sorted((int(k.removeprefix("alpha_t0_turn")), v) for k, v in m.items() if k.startswith("alpha_t0_turn"))
    if by_turn:
        print(f"  turns: trained on {m['train_turns']} assistant turns ({m['train_responses']} responses); held-out "
              f"α(T=0) by turn position " + "  ".join(f"{p}: {v:.3f}" for p, v in by_turn))
    if "chain" in m:
        print(f"  chains of {chain_text(m['chain'])}")
    print("  time: " + "  ".join(f"{k} {v:.0f}s" for k, v in result.timings.items())
          + f"  (total {sum(result.timings.values()):.0f}s)")
    print(f"  draft:        {result.export_dir}  (also {Path(cfg.distill.output_dir) / 'latest'})")
    if (result.export_dir / HF_ASSISTANT_DIR).exists():
        print(f"  HF assistant: {result.export_dir / HF_ASSISTANT_DIR}")
    formats = "vllm|gguf" if cfg.distill.family == "layers" else "vllm"
    print(f"  to serve:     draftops export {result.export_dir} --format {formats} --out DIR  (vLLM; gguf: llama.cpp)")
    if result.version:
        print(f"  MLflow:       {tracking_uri(cfg)}  run {result.run_id}  (experiment draftops-distill)")
        print(f"  registered:   {version_uri(cfg.tracking.registered_model, result.version)}  alias {result.alias}")


def layer_counts(text: str) -> list[int]:
    """`--sizes 1,2,4,6`: distinct positive layer counts, smallest first (argparse's type)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated layer counts, e.g. 1,2,4,6") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: layer counts are positive, e.g. 1,2,4,6")
    return sizes


def main(argv: list[str] | None = None) -> int:
    """`python -m distill.train --config FILE [key=value ...]` (what `accelerate launch -m distill.train` runs)."""
    parser = argparse.ArgumentParser(prog="distill.train")
    parser.add_argument("--config", default=None)
    parser.add_argument("--init-only", action="store_true")
    parser.add_argument("--register-only", action="store_true")
    parser.add_argument("--sizes", type=layer_counts, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.sizes:
            if args.init_only or args.register_only:
                parser.error("--sizes trains and registers a family: it takes neither --init-only nor --register-only")
            run_sizes(cfg, args.sizes)
        else:
            run_distill(cfg, init_only=args.init_only, register_only=args.register_only)
    except NonFiniteLoss as exc:
        print(f"draftops distill: error: {exc}", file=sys.stderr)
        return 3
    except (OperatorError, TrackingUnavailable, NothingToRegister, UnsafeCheckpoint, SourceError,
            RecordedMismatch) as exc:
        print(f"draftops distill: error: {exc}", file=sys.stderr)
        return 2
    except ModelBusy as exc:  # registration waited tracking.lock_timeout for a check; the draft is kept
        print(f"draftops distill: {exc}", file=sys.stderr)
        return EXIT_BUSY
    return 0


if __name__ == "__main__":
    sys.exit(main())
