"""`distill:`: how a draft is distilled from the target (draft family, data, loss, budget, registration)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.config.engine import ResponsesConfig

# the objectives `distill.losses.distillation_loss` computes; "ce": hard labels only (the baseline)
LossName = Literal["forward_kl", "reverse_kl", "jsd", "tvd", "argmax_ce", "ce", "log_acceptance", "kl_tv"]
# What each family trains with where a key is unset: the best of docs/results.md's ablation on the default job. A
# layer draft keeps the fields' own defaults; a feature draft starts as speculators' EAGLE-3 head does (random layer,
# the target's head rows frozen, norm before the residual, Muon + AdamW on a linear schedule, at 2e-3 where the peer
# takes 1e-3), trains for acceptance (kl_tv, each unrolled step weighted by its reach) and takes half the batch for
# 1.5 epochs: the layer draft's number of steps in about its training time.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "layers": {"loss": "forward_kl", "ttt_weighting": "uniform", "batch_size": 16, "epochs": 3},
    "features": {"loss": "kl_tv", "ttt_weighting": "reach", "init": "config", "train_head": False,
                 "norm_before_residual": True, "optimizer": "muon", "learning_rate": 2e-3, "lr_schedule": "linear",
                 "warmup_steps": 5, "min_lr_ratio": 0.0, "weight_decay": 0.01, "batch_size": 8, "epochs": 1.5},
}


class DistillConfig(Section):
    """`draftops distill`. The defaults are the embedded job on SmolLM2-135M-Instruct."""

    output_dir: str = Field("outputs/distill", description="Where checkpoints and the exported draft go.")
    resume: bool = Field(True, description="Continue from the last checkpoint of an identical job in output_dir.")
    register_model: bool = Field(True, description="Log the run to MLflow and register the exported draft.")
    family: Literal["layers", "features"] = Field(
        "layers", description="layers: a small LM (init below) that reads tokens; features: an EAGLE-3 head that "
        "reads the target's hidden states (one decoder layer, random as speculators starts it, or with init=checkpoint "
        "from a feature draft's speculators folder: a champion, an imported head). configs/default.yaml (`make "
        "distill`) sets features.")
    ttt_steps: int = Field(3, ge=1, description="features only: draft steps unrolled in training (training-time "
                           "test), each fed the draft's own previous output.")
    # draft initialization
    init: Literal["target_layers", "checkpoint", "config"] = Field(
        "target_layers", description="target_layers (features: config): copy init_layers + embeddings, norm, head "
        "from the target; "
        "checkpoint: start from init_checkpoint (a feature draft: its speculators folder); config: random init from "
        "the target's config + init_config (a feature draft: its layer and fc random, the head rows the target's, "
        "as speculators starts).")
    init_layers: list[int] = Field([0, 1], min_length=1, description="Target layers the draft starts from.")
    init_checkpoint: str | None = Field(None, description="Model source for init=checkpoint.")
    init_config: dict[str, Any] = Field({}, description="Config overrides for init=config, e.g. num_hidden_layers: 2.")
    draft_vocab_size: int = Field(
        8192, ge=0, description="Keep the N most frequent ids of the target's responses (+ special tokens) in the "
        "draft's lm_head; 0 keeps the full vocabulary.")
    train_embeddings: bool = Field(
        False, description="Also train the input embeddings (always, when tied to the head).")
    train_head: bool = Field(
        True, description="Train the head's rows; false (features' default) keeps the target's, as speculators does.")
    draft_intermediate_size: int | None = Field(
        None, ge=1, description="features only, with init=config: the draft layer's MLP width (null: the target's). "
        "A wider MLP is still an EAGLE-3 head: its layer config carries the width. A checkpoint keeps its own.")
    norm_before_residual: bool = Field(
        False, description="features only (their default: true): the draft layer adds its attention output to the "
        "normed features rather than the raw ones (speculators' EAGLE-3 default).")
    # data
    train_prompts: int = Field(0, ge=0, description="Train-split prompts used; 0: all of them.")
    responses_per_prompt: int = Field(
        8, ge=1, description="Target responses per prompt: the first greedy, the others sampled.")
    eval_prompts: int = Field(24, ge=1, description="Held-out prompts for α/τ evaluation.")
    max_new_tokens: int = Field(128, ge=1, description="Longest target response generated.")
    generation_temperature: float = Field(0.8, gt=0.0, description="Temperature of the sampled responses.")
    generation_batch_size: int = Field(64, ge=1)
    generation_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "The precision the target generates the training responses and top-k teacher in. auto: bfloat16 for an fp32 "
        "target on a CPU with bf16 units (AVX512_BF16 or AMX-BF16) where a measurement of its products at the "
        "generation batch, cached per machine, finds it faster (on a CPU: a bf16 copy on weights packed for oneDNN); "
        "else the target's own. The held-out responses, and so α and τ, always come from the target as loaded. "
        "docs/concepts.md#the-cpu-runtime."))
    responses: ResponsesConfig = Field(ResponsesConfig(), description=(
        "Where the training responses and their top-k teacher come from: the built-in generator or inference "
        "servers (docs/engines.md)."))
    teacher: Literal["topk", "online", "final"] = Field(
        "topk", description="topk: cache the target's top-k log-probs while it generates; online: run the target "
        "on every training batch; final (feature drafts): the target's whole distribution over the draft vocabulary "
        "(its mass elsewhere one bucket), from its final hidden states and log-normalizers cached beside the features "
        "by one more pass over the data.")
    topk: int = Field(64, ge=1, description="Teacher log-probs kept per response token (fp16 + int32 ids).")
    onpolicy_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of steps trained on continuations sampled from the current draft, "
        "scored by the target online.")
    onpolicy_temperature: float = Field(1.0, gt=0.0, description="Temperature of the draft's sampled proposals.")
    onpolicy_steps: int = Field(
        0, ge=0, description="Optimizer steps after the epochs on the draft's own chains of onpolicy_k "
        "tokens from every response position (greedy and sampled), scored by the target and weighted by the chance "
        "of being reached (docs/concepts.md#training-for-acceptance).")
    onpolicy_k: int = Field(3, ge=2, le=8, description="The chains' length in the on-policy stage.")
    onpolicy_lr_ratio: float = Field(0.1, gt=0.0, le=1.0, description="The on-policy stage's learning rate, constant, "
                                     "as a share of learning_rate (the epochs' schedule may end at 0).")
    # objective
    loss: LossName = Field(None, description=(
        "Divergence to the teacher; 'argmax_ce': cross-entropy on the teacher's most likely token at every position; "
        "'ce' is the plain cross-entropy baseline on the target's (sampled) tokens. Acceptance itself: "
        "'log_acceptance' −log Σ min(p, q); 'kl_tv' forward KL and 1 − Σ min(p, q) weighted by the batch's "
        "acceptance (docs/concepts.md#training-for-acceptance). Unset: the family's measured best, forward_kl for "
        "layers, kl_tv for features (docs/results.md#the-draft-what-distillation-buys)."))
    ttt_weighting: Literal["uniform", "reach"] = Field(None, description=(
        "features only: each training-time-test step's terms weighted the same (uniform), or by the chance that the "
        "draft reaches that step, the product of the earlier steps' acceptance at the same position (reach). Unset: "
        "reach for features, uniform for layers."))
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="jsd only: 0 = forward KL, 1 = reverse KL.")
    temperature: float = Field(1.0, gt=0.0, description="Distillation temperature (1 with a top-k teacher).")
    ce_weight: float = Field(0.0, ge=0.0, description="Weight of cross-entropy on the response tokens.")
    # optimization
    epochs: float = Field(None, gt=0, description="Passes over the training responses (whole global batches; a "
                          "fraction runs that share of the next pass). Unset: 3 for layers, 1.5 for features.")
    batch_size: int = Field(None, ge=1, description="Sequences per process per micro-batch. Unset: 16 for layers, 8 "
                            "for features.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw: AdamW over every trained parameter; muon (features' default, with lr 2e-3 on a "
        "linear schedule to 0 after 5 warmup steps, weight decay 0.01): Muon over the draft layers' weight matrices "
        "and AdamW over the rest (embeddings, head, norms), both at learning_rate.")
    lr_schedule: Literal["cosine", "linear"] = Field(
        "cosine", description="After warmup_steps, the decay to min_lr_ratio · learning_rate.")
    learning_rate: float = Field(3e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="The decay ends at this share of the lr.")
    max_grad_norm: float = Field(1.0, gt=0.0)
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Evaluate, keep and export an exponential moving average of the trained weights with this decay per "
        "optimizer step (e.g. 0.99); 0: the weights as trained."))
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description=(
        "Autocast of the draft's products (weights, optimizer and loss stay fp32), used where the device supports it. "
        "auto: bf16 on a CPU with bf16 units (AVX512_BF16 or AMX-BF16) where one training step of the draft, timed "
        "both ways and cached per machine, is faster with it; else full precision (and on GPUs: set bf16 there). "
        "docs/concepts.md#the-cpu-runtime."))
    max_steps: int = Field(0, ge=0, description="Stop after this many optimizer steps; 0: run all epochs.")
    # evaluation and checkpoints
    eval_every: int = Field(50, ge=1, description="Optimizer steps between held-out evaluations.")
    checkpoint_every: int = Field(25, ge=1, description="Optimizer steps between resumable checkpoints.")
    keep_checkpoints: int = Field(2, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data: Any) -> Any:
        """The keys a family trains with unless set (`FAMILY_DEFAULTS`)."""
        if isinstance(data, dict):
            family = "features" if data.get("family") == "features" else "layers"
            data = {**data}
            for key, value in FAMILY_DEFAULTS[family].items():
                if data.get(key) is None:
                    data[key] = value
        return data

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
        if self.family != "features" and self.teacher == "final":
            raise ValueError("distill.teacher=final applies to family 'features': it is cached beside the features")
        if self.draft_intermediate_size is not None and (self.family != "features" or self.init == "target_layers"):
            # a checkpoint keeps its saved width: the monitor's warm starts reuse a config that may set one
            raise ValueError("distill.draft_intermediate_size applies to a feature draft from init=config: a draft "
                             "from the target's layers keeps their MLP width")
        return self


