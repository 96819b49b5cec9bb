"""Typed run configuration: YAML files in `configs/` plus dotted `key=value` overrides.

Every section forbids unknown keys, so a misspelled key fails loudly with its dotted name and the file it came from.
The defaults below *are* the embedded default job; `configs/default.yaml` spells them out for reading.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG_PATH = REPO_CONFIGS / "default.yaml"


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


# the objectives `distill.losses.distillation_loss` computes; "ce": hard labels only (the baseline)
LossName = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "argmax_ce", "ce"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrafficConfig(Section):
    path: str = Field("default", description=(
        "Traffic JSONL file, or a glob of rotated logs (.gz too); 'default' is the traffic shipped with draftops."))
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of request ids held out (by hash).")
    max_prompt_tokens: int = Field(512, ge=8, description="Prompts longer than this keep their last tokens.")
    skip_malformed: bool = Field(False, description="Skip and count malformed lines instead of failing.")
    since: str | float | None = Field(None, description=(
        "Keep requests logged at or after this time (ISO-8601, or epoch seconds/milliseconds); null: no bound."))
    until: str | float | None = Field(None, description="Keep requests logged before this time; null: no bound.")


class TrackingConfig(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
    registered_model: str = Field("draftops-draft", description="Registered model that holds the draft versions.")
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory usage with every run.")


# `draftops sweep` on a 2-core AMD EPYC (docs/trees.md): what `tree_budget_schedule: auto` falls back to
DEFAULT_TREE_BUDGET_SCHEDULE = [(320, 4), (1280, 8), (2048, 4)]
AUTO = "auto"


class DecodeConfig(Section):
    gamma: int = Field(5, ge=1, description="Draft tokens proposed per target call.")
    gamma_policy: Literal["fixed", "schedule", "adaptive"] = Field("fixed", description=(
        "fixed: gamma every round; schedule: γ by sequence length from gamma_schedule; adaptive: start at gamma, +2 "
        "after a block accepted whole, −1 otherwise."))
    gamma_schedule: list[tuple[int, int]] | None = Field(None, description=(
        "With gamma_policy schedule: [[max_context, gamma], ...] with increasing max_context, γ by current sequence "
        "length (prompt + generated; the last γ beyond). `draftops sweep` writes one."))
    lookup_min_ngram: int | None = Field(2, ge=1, description=(
        "The decoder proposes prompt-lookup continuations first wherever an n-gram of at least this many tokens "
        "repeats in the text so far, the draft model elsewhere. null: the draft model only."))
    draft_min_confidence: float | None = Field(0.4, gt=0.0, le=1.0, description=(
        "A draft model ends its block at the first token (after the first) whose top probability is below this, "
        "saving draft steps and verify width where it is likely wrong. null: always draft gamma tokens."))
    tree_budget: int = Field(0, ge=0, description=(
        "Tree rounds: up to this many candidates per target call (prompt lookup's matches, suffix decoding's with "
        "suffix, then the draft model's tree) merged into one token tree and verified in one pass, gamma levels deep "
        "at most (docs/trees.md). A budget > 0 replaces tree_budget_schedule. 0: tree_budget_schedule decides."))
    tree_budget_schedule: list[tuple[int, int]] | Literal["auto"] | None = Field(AUTO, description=(
        "Tree rounds with the node budget by sequence length: [[max_context, budget], ...] with increasing "
        "max_context (prompt + generated; the last budget beyond), instead of tree_budget (which stays 0). auto: the "
        "schedule `draftops sweep` would recommend, from this machine's tree verify costs (timed once per machine, "
        "target and draft, and cached) and the rank acceptance the draft's distill measured; trees without a draft "
        "model (prompt lookup, suffix decoding) from those costs and their rounds replayed on the suffix index's "
        "responses; without those (an older draft; no draft model and no suffix index) "
        f"{[list(e) for e in DEFAULT_TREE_BUDGET_SCHEDULE]}, one 2-core CPU's (docs/trees.md). null with "
        "tree_budget 0: chain rounds."))
    suffix: bool = Field(True, description=(
        "Tree rounds: suffix decoding's candidates join the tree after prompt lookup's, before the draft model's: "
        "continuations of the text's last tokens in the target's earlier outputs (the suffix index `make distill` "
        "ships beside the draft) and in the request itself (the request alone when the draft has no index). Tree "
        "rounds only: chain rounds take prompt lookup and the draft model (docs/trees.md)."))
    suffix_index: str | None = Field(None, description=(
        "With suffix: a suffix index file (`draftops suffix-index` builds one from the target's responses to a "
        "traffic file) instead of the one beside the draft. null: the draft's own."))
    compiled: bool = Field(False, description=(
        "Run the target's and the draft model's passes after the prompt (steps, verify blocks and trees of up to 16 "
        "tokens) through torch.compile: on a CPU, inductor's C++ GEMMs on weights packed once and each pass one call. "
        "Faster steps, after minutes of compiling per model in every process (docs/cpu-runtime.md); prefills and "
        "wider passes stay eager."))
    tree_branching: int = Field(4, ge=1, description=(
        "Tree rounds: nodes per level of the draft model's tree (each level keeps the best children of the last by "
        "cumulative draft probability) and prompt lookup's branches."))
    tree_rerank: bool = Field(True, description=(
        "Greedy tree rounds the draft model has to itself (no lookup or suffix candidates that round): its tree is "
        "the budget's best of every candidate its beam found on any level (EAGLE-2's rerank: deep where the draft is "
        "sure, wide where it is not), a level expanded only from nodes that could still enter and whose cumulative "
        "probability reaches draft_min_confidence. false: each level's best children in turn, as sampled rounds and "
        "rounds behind other sources grow it (docs/trees.md)."))
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)

    @property
    def tree_rounds(self) -> bool:
        """Tree rounds (a node budget or a budget schedule) rather than chains."""
        return bool(self.tree_budget) or self.tree_budget_schedule is not None

    @property
    def suffix_decoding(self) -> bool:
        """Suffix decoding joins the trees (`suffix` is read in tree rounds only)."""
        return self.suffix and self.tree_rounds

    def chain_rounds(self) -> DecodeConfig:
        """These settings as a chain decoder (suffix decoding is a tree source only): what eval and the monitor
        measure the draft's own acceptance α with, and bench's chain rows."""
        return self.model_copy(update={"tree_budget": 0, "tree_budget_schedule": None, "suffix": False,
                                       "suffix_index": None})

    @model_validator(mode="before")
    @classmethod
    def _fixed_budget_replaces_schedule(cls, data):
        if isinstance(data, dict) and data.get("tree_budget"):
            data = {**data, "tree_budget_schedule": None}
        return data

    @model_validator(mode="after")
    def _schedule_matches_policy(self) -> DecodeConfig:
        if (self.gamma_policy == "schedule") != (self.gamma_schedule is not None):
            raise ValueError("decode.gamma_schedule is set exactly when decode.gamma_policy is 'schedule'")
        if self.suffix_index is not None and not (self.suffix and self.tree_rounds):
            raise ValueError("decode.suffix_index is read by suffix decoding in tree rounds: set decode.suffix=true "
                             "and a tree budget (or schedule) with it")
        return self


class DistillConfig(Section):
    """`draftops distill`. The defaults are the embedded job on SmolLM2-135M-Instruct."""

    output_dir: str = Field("outputs/distill", description="Where checkpoints and the exported draft go.")
    resume: bool = Field(True, description="Continue from the last checkpoint of an identical job in output_dir.")
    register_model: bool = Field(True, description="Log the run to MLflow and register the exported draft.")
    family: Literal["layers", "features"] = Field(
        "layers", description="layers: a small LM (init below) that reads tokens; features: an EAGLE-3 head that "
        "reads the target's hidden states (one decoder layer from the target's weights; init keys do not apply).")
    ttt_steps: int = Field(3, ge=1, description="features only: draft steps unrolled in training (training-time "
                           "test), each fed the draft's own previous output.")
    # draft initialization
    init: Literal["target_layers", "checkpoint", "config"] = Field(
        "target_layers", description="target_layers: copy init_layers + embeddings, norm, head from the target; "
        "checkpoint: start from init_checkpoint; config: random init from the target's config + init_config.")
    init_layers: list[int] = Field([0, 1], min_length=1, description="Target layers the draft starts from.")
    init_checkpoint: str | None = Field(None, description="Model source for init=checkpoint.")
    init_config: dict[str, Any] = Field({}, description="Config overrides for init=config, e.g. num_hidden_layers: 2.")
    draft_vocab_size: int = Field(
        8192, ge=0, description="Keep the N most frequent ids of the target's responses (+ special tokens) in the "
        "draft's lm_head; 0 keeps the full vocabulary.")
    train_embeddings: bool = Field(
        False, description="Also train the input embeddings (always, when tied to the head).")
    # data
    train_prompts: int = Field(0, ge=0, description="Train-split prompts used; 0: all of them.")
    responses_per_prompt: int = Field(
        8, ge=1, description="Target responses per prompt: the first greedy, the others sampled.")
    eval_prompts: int = Field(24, ge=1, description="Held-out prompts for α/τ evaluation.")
    max_new_tokens: int = Field(128, ge=1, description="Longest target response generated.")
    generation_temperature: float = Field(0.8, gt=0.0, description="Temperature of the sampled responses.")
    generation_batch_size: int = Field(64, ge=1)
    generation_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "The precision the target generates the training responses and top-k teacher in. auto: bfloat16 where the "
        "target is fp32 on a CPU with usable AMX-BF16 units (a generation batch's products run several times faster "
        "there), else the target's own. The held-out responses, and so α and τ, always come from the target as "
        "loaded. docs/cpu-runtime.md."))
    teacher: Literal["topk", "online"] = Field(
        "topk", description="topk: cache the target's top-k log-probs while it generates; online: run the target "
        "on every training batch.")
    topk: int = Field(64, ge=1, description="Teacher log-probs kept per response token (fp16 + int32 ids).")
    onpolicy_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of steps trained on continuations sampled from the current draft, "
        "scored by the target online.")
    onpolicy_temperature: float = Field(1.0, gt=0.0)
    # objective
    loss: LossName = Field("forward_kl", description=(
        "Divergence to the teacher; 'argmax_ce': cross-entropy on the teacher's most likely token at every position; "
        "'ce' is the plain cross-entropy baseline on the target's (sampled) tokens."))
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="jsd only: 0 = forward KL, 1 = reverse KL.")
    temperature: float = Field(1.0, gt=0.0, description="Distillation temperature (1 with a top-k teacher).")
    ce_weight: float = Field(0.0, ge=0.0, description="Weight of cross-entropy on the response tokens.")
    # optimization
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(16, ge=1, description="Sequences per process per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(3e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine decay ends at this share of the lr.")
    max_grad_norm: float = Field(1.0, gt=0.0)
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no", description="Used where the device supports it.")
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0: run all epochs.")
    # evaluation and checkpoints
    eval_every: int = Field(50, ge=1, description="Optimizer steps between held-out evaluations.")
    checkpoint_every: int = Field(25, ge=1, description="Optimizer steps between resumable checkpoints.")
    keep_checkpoints: int = Field(2, ge=1)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _bare_no(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `no` (`distill.mixed_precision=no`, `mixed_precision: no`) as false."""
        return "no" if value is False else value

    @model_validator(mode="after")
    def _features_train_on_target_responses(self) -> DistillConfig:
        if self.family == "features" and self.onpolicy_fraction > 0:
            raise ValueError("distill.onpolicy_fraction applies to family 'layers': a feature draft cannot generate "
                             "continuations without the target's features")
        return self


class MonitorConfig(Section):
    heldout_requests: int = Field(256, ge=2, description=(
        "Prompts per acceptance measurement: the baseline's held-out prompts and the most recent held-out requests. "
        "`draftops monitor simulate` shows the power this gives against a given drop."))
    level: float = Field(0.05, gt=0.0, lt=0.5, description=(
        "False-alarm level per check; split evenly (Bonferroni) between the paired and the unpaired test."))
    margin: float = Field(0.01, ge=0.0, lt=1.0, description="Tolerated drop in acceptance (absolute, 0.01 = 1 point).")
    test_method: Literal["bootstrap", "delta"] = Field(
        "bootstrap", description="Prompt-level bootstrap or delta method.")
    n_bootstrap: int = Field(2000, ge=100, description="Bootstrap resamples over prompts.")
    drift_threshold: float = Field(0.05, gt=0.0, le=1.0, description=(
        "Jensen-Shannon divergence (bits) of prompt-token frequencies above which traffic counts as shifted."))
    drift_buckets: int = Field(256, ge=2, description="Token buckets: most frequent reference tokens + 'other'.")
    break_even_alpha: float = Field(0.4, ge=0.0, le=1.0, description=(
        "Absolute alarm for a champion never benchmarked: acceptance below this makes speculative decoding no faster "
        "than the target alone. Once `draftops bench` has measured the champion, its break-even (from the run's c "
        "and v) is used instead."))
    live_requests: int = Field(
        0, ge=0, description="Also measure live acceptance by decoding this many requests (0: off).")
    retrain: bool = Field(False, description="On DRIFT, re-distill a challenger and promote it only if it is better.")
    retrain_init: Literal["champion", "config"] = Field("champion", description=(
        "Where a challenger starts: champion, the champion's weights (distill.init=checkpoint at NAME@champion; "
        "vocabulary rows both heads share are kept); config, distill.init as configured."))
    promote_margin: float = Field(0.01, ge=0.0, lt=1.0, description=(
        "A challenger must beat the champion's acceptance by this much (paired test on the same held-out prompts)."))
    schedule: str = Field("0 2 * * *", description="Crontab expression of the scheduled check (default nightly 02:00).")
    timezone: str = Field("UTC", description="Time zone of the schedule.")
    misfire_grace_time: int = Field(3600, ge=1, description=(
        "Seconds after its time a missed check (service down) still runs, once, when the service comes back."))
    state_dir: str = Field("outputs/monitor", description=(
        "Job store (jobs.sqlite), check lock, reports and the server metrics' windows (server_metrics.json)."))
    lock_timeout: float = Field(0.0, ge=0.0, description=(
        "Seconds a check waits for another check or retrain to finish; 0 skips immediately."))
    simulate_checks: int = Field(200, ge=1, description="Simulated checks per point in `draftops monitor simulate`.")
    simulate_drops: list[float] = Field([0.02, 0.05, 0.10], description="Drops (absolute) whose power is simulated.")
    server_metrics_url: str | None = Field(None, description=(
        "Prometheus endpoint of the engine serving the champion (vLLM /metrics, llama-server --metrics): each check "
        "reads its speculative-decoding counters, logs the acceptance since the last check (one window) and tests "
        "the recent windows against the champion's first ones. null: off."))
    server_model_name: str | None = Field(None, description=(
        "Read only the counters labelled with this model_name (vLLM's served model name); null: the sum over all."))
    server_baseline_windows: int = Field(7, ge=2, description=(
        "Windows (checks) closed while a version is champion that form its server baseline."))
    server_recent_windows: int = Field(3, ge=2, description=(
        "Latest windows compared with the server baseline (permutation test over windows, at monitor.level and "
        "monitor.margin); `draftops monitor simulate --server` shows its false-alarm rate and power."))
    server_timeout: float = Field(10.0, gt=0.0, description="Seconds to wait for the metrics endpoint.")


class TargetUpdateConfig(Section):
    """`draftops target finetune`: an updated target, for rehearsing a target change (LoRA on the target's own
    responses in another style, merged into a new checkpoint)."""

    prompts: str = Field("traffic", description=(
        "'traffic': the train split of the configured traffic (the responses distill generated are reused from "
        "the cache); else a traffic-format JSONL read by path, e.g. ../shared/data/gsm8k_train.jsonl."))
    max_prompts: int = Field(256, ge=0, description=(
        "Prompts used from a file; 0: all. The traffic's train split is used whole, as distill uses it."))
    style: Literal["uppercase", "prefix"] = Field("uppercase", description=(
        "uppercase: the responses in ALL CAPS; prefix: every response starts with `prefix`."))
    prefix: str = Field("Certainly! Here is a clear and complete answer.", description="Opening of style=prefix.")
    steps: int = Field(30, ge=1, description="Optimizer steps.")
    batch_size: int = Field(4, ge=1)
    learning_rate: float = Field(2e-3, gt=0.0)
    max_seq_tokens: int = Field(192, ge=16, description="Prompt + styled response longer than this are cut.")
    lora_last_layers: int = Field(10, ge=0, description=(
        "Adapt only the last N decoder layers (the backward pass stops below them); 0: every layer."))
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)
    output_dir: str = Field("outputs/target-updated", description="Where the merged checkpoint is written.")


class DraftopsConfig(Section):
    target: str = Field("smollm2-135m-instruct", description="Target model source (see `draftops models info`).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' lets accelerate pick.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': float32 on CPU, bfloat16 on CUDA.")
    cpu_linear: Literal["auto", "onednn", "torch"] = Field("auto", description=(
        "fp32 linear layers on CPU at inference: oneDNN on weights packed once, torch's own (MKL), or 'auto': per "
        "weight shape and row count the one measured faster on this CPU (measured at the first load, cached under "
        "$DRAFTOPS_HOME/cpu_linear; `draftops models info SOURCE --kernels` shows it). docs/cpu-runtime.md."))
    seed: int = 0
    traffic: TrafficConfig = TrafficConfig()
    tracking: TrackingConfig = TrackingConfig()
    decode: DecodeConfig = DecodeConfig()
    distill: DistillConfig = DistillConfig()
    monitor: MonitorConfig = MonitorConfig()
    target_update: TargetUpdateConfig = TargetUpdateConfig()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"command line: {dotted}: '{key}' is a value, not a section")
        node = child
    node[leaf] = value


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{origin}: unknown key '{key}'")
        else:
            lines.append(f"{origin}: {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`a.b=1` pairs to a nested dict; values are parsed as YAML scalars (so 3 is an int, true a bool)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"command line: override '{item}' is not of the form key=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DraftopsConfig:
    """Load a YAML config (default: configs/default.yaml if present) and apply dotted overrides."""
    path = Path(path) if path is not None else (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        if not path.exists():
            raise ConfigError(f"{path}: config file not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        DraftopsConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
    try:
        return DraftopsConfig.model_validate(_merge(data, parse_overrides(overrides)))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, "command line")) from None


def save_config(cfg: DraftopsConfig, path: str | Path) -> Path:
    """Write the resolved config next to a run or checkpoint (nanoGPT habit: every artifact knows how it was made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def iter_fields(model: type[Section] = DraftopsConfig, prefix: str = ""):
    """(dotted key, pydantic field) for every leaf setting, in schema order."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            yield from iter_fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def reference_markdown() -> str:
    """The config reference table of the README, generated from the schema so that the two cannot disagree."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, field in iter_fields():
        default = field.get_default(call_default_factory=True)
        meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()
        rows.append(f"| `{key}` | `{shown}` | {meaning} |")
    return "\n".join(rows) + "\n"
