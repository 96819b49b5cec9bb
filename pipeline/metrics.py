"""The one metric vocabulary of draftops: every stage logs its figures to MLflow under these names.

A draft version's registration run (distill), every eval and bench of it, and every monitor check use the same
names for the same quantities, so MLflow's compare view lines them up column by column. Metric names are
`<group>/<quantity>[/<category>]`; MLflow's UI groups the charts by the part before the first slash. Tags and aliases
are named here too, so every stage writes and reads the same strings. What each name means: docs/reference.md#metrics
and #tags-and-aliases.
"""
from __future__ import annotations

import re

# acceptance
ALPHA_T0 = "acceptance/alpha_t0"
ALPHA_T1 = "acceptance/alpha_t1"
ACCEPTANCE_DRAFT = "acceptance/draft"
ACCEPTANCE_DRAFT_LOW = "acceptance/draft_ci_low"
ACCEPTANCE_DRAFT_HIGH = "acceptance/draft_ci_high"
ACCEPTANCE_DECODER = "acceptance/decoder"
ACCEPTANCE_DECODER_LOW = "acceptance/decoder_ci_low"
ACCEPTANCE_DECODER_HIGH = "acceptance/decoder_ci_high"
ACCEPTANCE_SERVER = "acceptance/server"  # a serving engine's counters over one window (monitor.fleet.counters)
DRAFT_EFFICIENCY = "acceptance/draft_efficiency"

# speed
SPEEDUP = "speed/speedup_vs_target"
SPEEDUP_LOW = "speed/speedup_vs_target_ci_low"
SPEEDUP_HIGH = "speed/speedup_vs_target_ci_high"
SPEEDUP_HF_ASSISTED = "speed/hf_assisted_speedup_vs_target"
SPEEDUP_PREDICTED = "speed/predicted_speedup"
TREES_VS_CHAIN = "speed/trees_vs_chain"  # bench: the tree decoder's throughput over the same decoder in chain rounds
COST_RATIO_C = "speed/cost_ratio_c"
VERIFY_RATIO_V = "speed/verify_ratio_v"
VERIFY_RATIO_V_TREE = "speed/verify_ratio_v_tree"  # bench, tree rounds: a verify of the round's node budget
OVERHEAD_FREE_BOUND = "speed/overhead_free_bound"
IN_RUN_COST_RATIO_C = "speed/in_run_cost_ratio_c"
IN_RUN_VERIFY_RATIO_V = "speed/in_run_verify_ratio_v"
IN_RUN_BOUND = "speed/in_run_overhead_free_bound"
BREAK_EVEN_ALPHA = "speed/break_even_alpha"  # the draft alone in chains' in-run c, v; the monitor's alarm
TOKENS_PER_S = "speed/tokens_per_s"
TARGET_TOKENS_PER_S = "speed/target_tokens_per_s"
TARGET_TORCH_KERNELS_TOKENS_PER_S = "speed/target_torch_kernels_tokens_per_s"  # the target on torch's stock kernels
NEW_TOKENS = "speed/new_tokens"
LLAMA_CPP_TOKENS_PER_S = "speed/llama_cpp_target_tokens_per_s"  # llama.cpp's target alone (decode.measure.bench)
LLAMA_CPP_SPECULATIVE_TOKENS_PER_S = "speed/llama_cpp_speculative_tokens_per_s"  # llama.cpp with the GGUF draft
LLAMA_CPP_SPEEDUP = "speed/llama_cpp_speculative_speedup_vs_llama_cpp_target"
ACCEPTANCE_LLAMA_CPP = "acceptance/llama_cpp"  # accepted / drafted tokens, as llama-server reports them

# the draft itself
DRAFT_PARAMS = "draft/params"
DRAFT_LAYERS = "draft/layers"
DRAFT_VOCAB_SIZE = "draft/vocab_size"

# training (per step)
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
TRAIN_FINAL_LOSS = "train/final_loss"
TRAIN_BEST_STEP = "train/best_step"
TRAIN_RESPONSES = "train/responses"
TRAIN_TOKENS = "train/tokens"

# monitor: one check
MONITOR_ACCEPTANCE_NOW = "monitor/acceptance_now"
MONITOR_ACCEPTANCE_BASELINE = "monitor/acceptance_baseline"
MONITOR_ACCEPTANCE_THRESHOLD = "monitor/acceptance_threshold"  # baseline − margin: below it (significantly) is DRIFT
MONITOR_BREAK_EVEN = "monitor/break_even_alpha"
MONITOR_DROP = "monitor/drop"
MONITOR_DROP_CI_LOW = "monitor/drop_ci_low"
MONITOR_DROP_CI_HIGH = "monitor/drop_ci_high"
MONITOR_P_VALUE = "monitor/p_value"
MONITOR_TRAFFIC_JS = "monitor/traffic_js"
MONITOR_TRAFFIC_PSI = "monitor/traffic_psi"
MONITOR_DRIFT = "monitor/drift"
MONITOR_ERROR = "monitor/error"  # 1 when a measurement was not a finite number: the check's decision is ERROR
MONITOR_TARGET_CHANGED = "monitor/target_changed"
MONITOR_GATE_GAIN = "monitor/gate_gain"
MONITOR_GATE_P_VALUE = "monitor/gate_p_value"
MONITOR_PROMOTED = "monitor/promoted"

# sweep: the boundary map
SWEEP_GAP_MEAN = "sweep/gap_mean"  # measured / predicted speedup − 1 over the measured cells
SWEEP_GAP_MEAN_ABS = "sweep/gap_mean_abs"
SWEEP_INT8_SPEEDUP = "sweep/quantization/int8_speedup"  # the int8 target alone / the fp32 target alone
SWEEP_INT8_KL = "sweep/quantization/int8_kl"  # next-token KL(fp32 ‖ int8), nats, on held-out responses
SWEEP_INT8_AGREEMENT = "sweep/quantization/int8_agreement"  # share of positions where int8's argmax is fp32's
SWEEP_SPECULATIVE_SPEEDUP = "sweep/quantization/speculative_speedup"  # measured in the same run as the int8 rows
SWEEP_RECOMMENDED_LAYERS = "sweep/size/recommended_layers"  # the draft size with the best mean predicted speedup

# Tag and alias values are what existing MLflow stores hold: never rename one.

# model-version tags that link a version to its runs
DISTILL_RUN_TAG = "draftops.distill_run"
DISTILL_JOB_TAG = "draftops.distill_job"  # the distill job (its key) a version holds: a job is registered once
DRIFT_DEMO_TAG = "draftops.drift_demo"  # on a registered model the drift demo created (and may delete)
LATEST_EVAL_RUN_TAG = "draftops.latest_eval_run"
LATEST_BENCH_RUN_TAG = "draftops.latest_bench_run"
BASELINE_RUN_TAG = "draftops.monitor.baseline_run_id"  # the monitor run whose artifact holds the version's baseline

# lineage, on runs and on model versions
STAGE_TAG = "draftops.stage"  # every run: distill, eval, bench, sweep, monitor, target
GIT_SHA_TAG = "draftops.git_sha"
TARGET_SOURCE_TAG = "draftops.target_source"
TARGET_FINGERPRINT_TAG = "draftops.target_fingerprint"  # the target a draft was distilled for, or a run measured
DATA_FINGERPRINT_TAG = "draftops.data_fingerprint"
TEACHER_TAG = "draftops.teacher"  # what generated the training responses and their top-k: builtin or an engine
VERSION_SOURCE_TAG = "draftops.source"  # the stage that made a model version: "distill", or "import"
# a version made elsewhere (`draftops models import`): the folder it came from, its layout, the verifier it names
IMPORTED_FROM_TAG = "draftops.imported_from"
IMPORT_LAYOUT_TAG = "draftops.import_layout"  # speculators | eagle
IMPORT_VERIFIER_TAG = "draftops.import_verifier"
GAMMA_TAG = "gamma"  # the draft length γ a version's τ figure was measured at
LOSS_KIND_TAG = "loss_kind"

# which draft a run measured, and where a distill run registered its draft
DRAFT_SOURCE_TAG = "draftops.draft_source"
DRAFT_FINGERPRINT_TAG = "draftops.draft_fingerprint"
DRAFT_VERSION_TAG = "draftops.draft_version"  # NAME/VERSION, on eval and bench runs of a registered draft
DRAFTS_TAG = "draftops.drafts"  # the comma-separated drafts of a sweep
REGISTERED_VERSION_TAG = "draftops.registered_version"  # NAME/VERSION, on the distill run that registered it
REGISTERED_MODEL_TAG = "draftops.registered_model"  # on monitor runs

# a target update (`draftops target finetune`)
BASE_TARGET_FINGERPRINT_TAG = "draftops.base_target_fingerprint"
TARGET_PATH_TAG = "draftops.target_path"

# monitor runs: one check (or rollback)
MONITOR_DECISION_TAG = "draftops.monitor.decision"  # OK, DRIFT, ERROR, DEPLOY_MISMATCH, DEPLOY_FAILED, ROLLBACK
MONITOR_CAUSE_TAG = "draftops.monitor.cause"
MONITOR_CHAMPION_VERSION_TAG = "draftops.monitor.champion_version"
MONITOR_CHAMPION_TARGET_FINGERPRINT_TAG = "draftops.monitor.champion_target_fingerprint"
MONITOR_ACCEPTANCE_SOURCE_TAG = "draftops.monitor.acceptance_source"
MONITOR_CHALLENGER_VERSION_TAG = "draftops.monitor.challenger_version"
MONITOR_PROMOTED_TAG = "draftops.monitor.promoted"
MONITOR_ROLLED_BACK_FROM_TAG = "draftops.monitor.rolled_back_from"
MONITOR_ERROR_TAG = "draftops.monitor.error"
# model-version tags the monitor sets when it moves the champion alias
PROMOTED_AT_TAG = "draftops.monitor.promoted_at"
ROLLED_BACK_AT_TAG = "draftops.monitor.rolled_back_at"

# deployments (monitor.release): tags of the deployed model version, and of the deploy run
DEPLOY_FOLDER_TAG = "draftops.deploy.folder"
DEPLOY_FORMAT_TAG = "draftops.deploy.format"
DEPLOYED_AT_TAG = "draftops.deploy.deployed_at"
DEPLOY_RUN_TAG = "draftops.deploy.run_id"
DEPLOY_VERSION_TAG = "draftops.deploy.version"  # on a deploy run: the version it deployed
DEPLOY_ACTION_TAG = "draftops.deploy.action"  # on a deploy run: deploy, rollback (after a mismatch), reload
# the engine check (monitor.check.engine_acceptance): the engine's acceptance over its windows vs the draft's
# offline figure
ENGINE_ACCEPTANCE = "monitor/engine/acceptance"
ENGINE_EXPECTED = "monitor/engine/expected"
ENGINE_MISMATCH = "monitor/engine/mismatch"
MONITOR_DEPLOY_MISMATCH = "monitor/deploy_mismatch"
MONITOR_DEPLOY_FAILED = "monitor/deploy_failed"  # 1 when a deploy the check ran failed: the decision is DEPLOY_FAILED

# aliases of the registered model (stages are deprecated in MLflow 3)
CHAMPION = "champion"  # what serves
CHALLENGER = "challenger"  # a new distillation waiting for the monitor's gate
PREVIOUS_CHAMPION = "previous-champion"  # where a rollback goes


def size_alias(layers: int) -> str:
    """The alias of the newest registered draft of `layers` decoder layers (`draftops distill --sizes`)."""
    return f"layers-{layers}"


def _key(text: str) -> str:
    """A category or phase name as MLflow accepts it in a metric name."""
    return re.sub(r"[^0-9A-Za-z_.-]", "_", text)


def alpha_at(temperature: float) -> str:
    """α at a sampling temperature: `acceptance/alpha_t0`, `acceptance/alpha_t1`, `acceptance/alpha_t0.7`."""
    return f"acceptance/alpha_t{float(temperature):g}"


def by_target_confidence(metric: str, low: float, high: float) -> str:
    """An acceptance over the tokens where the target's own top probability is in [low, high):
    `acceptance/alpha_t0_by_target_confidence/0.5-0.8` (`decode.acceptance.alpha_by_target_confidence`)."""
    return f"{metric}_by_target_confidence/{float(low):g}-{float(high):g}"


def outside_draft_vocabulary(metric: str) -> str:
    """The target's probability (warped as for `metric`) on ids outside the draft's vocabulary, the part of α no
    draft of that vocabulary reaches: `acceptance/alpha_t0_outside_draft_vocabulary`."""
    return f"{metric}_outside_draft_vocabulary"


def tau_at(gamma: int) -> str:
    return f"acceptance/tau_gamma{int(gamma)}"


def position(i: int) -> str:
    """Acceptance at draft position i (1-based)."""
    return f"acceptance/pos_{int(i)}"


def chain_position(k: int, i: int) -> str:
    """In chains of k drafts, the share of drafts whose tokens 1..i (1-based) were all accepted, as vLLM counts
    `spec_decode_num_accepted_tokens_per_pos` over its drafts (`decode.chain_acceptance`): `acceptance/chain3_pos_1`."""
    return f"acceptance/chain{int(k)}_pos_{int(i)}"


def acceptance_length(k: int) -> str:
    """The mean acceptance length of chains of k drafts, 1 + Σ_i `chain_position(k, i)` (vLLM's and SpecForge's AL):
    `acceptance/chain3_length`."""
    return f"acceptance/chain{int(k)}_length"


def chain_metrics(chain: dict) -> dict[str, float]:
    """The figures of a `decode.chain_acceptance.chain_summary` under these names (the length with its interval)."""
    k = chain["k"]
    out = {chain_position(k, i + 1): rate for i, rate in enumerate(chain["per_position"])}
    out.update({acceptance_length(k): chain["length"], f"{acceptance_length(k)}_ci_low": chain["length_low"],
                f"{acceptance_length(k)}_ci_high": chain["length_high"]})
    return finite(out)


def server_position(i: int) -> str:
    """A serving engine's per-draft acceptance at draft position i (1-based): not given the position was reached."""
    return f"acceptance/server_pos_{int(i)}"


def replica_metric(replica: str, quantity: str) -> str:
    """One serving replica's latest window acceptance or window test (`monitor/replica/<name>/drop`)."""
    return f"monitor/replica/{_key(replica)}/{quantity}"


def decoder_speedup(row: str) -> str:
    """Bench: the speedup of one of its other decoder rows (`chain`, `draft_only`, a --compare name, ...)."""
    return f"speed/{_key(row)}_speedup_vs_target"


def per_category(metric: str, category: str) -> str:
    return f"{metric}/{_key(category)}"


def seconds(phase: str) -> str:
    return f"time/{_key(phase)}_s"


def monitor_test(test: str, quantity: str) -> str:
    """A quantity of one of the monitor's drop tests: `monitor/paired/drop`, `monitor/unpaired/p_value`,
    `monitor/server/drop` (the serving engine's windows)."""
    return f"monitor/{test}/{quantity}"


def sweep_batch(batch: int) -> str:
    """The best draft's predicted speedup at batch size B on the sweep's batch axis: `sweep/batch_best_speedup/b8`."""
    return f"sweep/batch_best_speedup/b{int(batch)}"


def sweep_size(quantity: str, layers: int) -> str:
    """A figure of a draft LM on the sweep's draft-size axis: `sweep/size/predicted_speedup/layers4`."""
    return f"sweep/size/{quantity}/layers{int(layers)}"


def sweep_cell(quantity: str, context: int, new_tokens: int) -> str:
    """A per-cell figure of the sweep's map: `sweep/best_speedup/ctx512_gen128`, `sweep/break_even_alpha/...`."""
    return f"sweep/{quantity}/ctx{int(context)}_gen{int(new_tokens)}"


def finite(metrics: dict[str, float | int | None]) -> dict[str, float]:
    """Only real numbers (MLflow rejects None and NaN is noise in the compare view)."""
    return {k: float(v) for k, v in metrics.items() if v is not None and v == v}


def tag_value(value: float) -> str:
    """A figure as a model-version tag: integers as integers, the rest to 4 decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.4f}"
