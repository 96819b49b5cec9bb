import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from decode.drafters.suffix import load_suffix_index
from decode.factory import build_decoder
from decode.models.feature_draft import FeatureDraft
from decode.runtime.forward import ModelRunner, greedy_decode, target_features
from decode.serving.export import GGUF, HF, SPECULATORS, VLLM, ExportError, draft_source, export_format
from decode.serving.loading import load_draft, load_model
from decode.serving.speculators import load_speculators
from decode.tree_budget_prediction import TREE_BUDGETS, load_rank_acceptance
from distill.checkpoints import latest_checkpoint
from distill.data.onpolicy import draft_continuations
from distill.loop import NonFiniteLoss
from distill.train import (
    DistillResult,
    layer_counts,
    make_accelerator,
    print_summary,
    run_distill,
    run_sizes,
    sizes_config,
)
from pipeline import metrics
from pipeline.config import DecodeConfig, load_config, save_config
from pipeline.sources import load_checkpoint, save_checkpoint
from tests.conftest import make_tokenizer, reset_accelerate_state
from tests.decode.serving.test_gguf import vocabulary_gguf
from tests.distill.test_step import SEQ
from tests.distill.tiny_job import tiny_config
from tests.families import FAMILIES, tiny_family

REPO = Path(__file__).resolve().parents[2]


def test_distill_end_to_end_exports_registers_and_serves_as_assistant(isolated_home):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    from pipeline.sources import resolve_model
    from pipeline.tracking import setup_mlflow

    cfg = tiny_config(isolated_home, "distill.max_steps=8")
    result = run_distill(cfg)
    assert len(result.history) == 8 and [e["step"] for e in result.evals] == [4, 8]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in result.history)
    assert result.alias == "champion" and result.version == "1"
    assert set(result.timings) >= {"generation_with_teacher_topk", "training", "eval", "export", "register"}
    m = result.metrics  # α with its bootstrap interval over the held-out prompts
    assert m["alpha_t0_low"] <= m["alpha_t0"] <= m["alpha_t0_high"] and m["alpha_t1_low"] <= m["alpha_t1_high"]

    setup_mlflow(cfg)
    version = MlflowClient().get_model_version(cfg.tracking.registered_model, "1")
    target = resolve_model(cfg.target)
    assert version.tags["draftops.target_fingerprint"] == target.fingerprint
    assert version.tags["draftops.data_fingerprint"] == result.data_fingerprint
    assert float(version.tags[metrics.tau_at(cfg.decode.gamma)]) == pytest.approx(result.metrics["tau"], abs=1e-4)
    assert float(version.tags[metrics.ALPHA_T0]) == pytest.approx(result.metrics["alpha_t0"], abs=1e-4)
    assert int(version.tags[metrics.DRAFT_VOCAB_SIZE]) == len(result.token_ids)
    assert {metrics.ALPHA_T1, metrics.DRAFT_PARAMS, "draftops.git_sha"} <= set(version.tags)
    assert version.tags[metrics.DISTILL_RUN_TAG] == result.run_id
    assert (f"reduced vocabulary of {len(result.token_ids)} of" in version.description
            and target.fingerprint in version.description)
    run = MlflowClient().get_run(result.run_id)
    assert run.data.metrics[metrics.ALPHA_T0] == pytest.approx(result.metrics["alpha_t0"])
    assert run.data.metrics[metrics.DRAFT_VOCAB_SIZE] == len(result.token_ids)
    # the draft in chains of 3 as vLLM counts them, on the run and the version
    assert run.data.metrics[metrics.acceptance_length(3)] == pytest.approx(m["chain"]["length"])
    assert float(version.tags[metrics.chain_position(3, 1)]) == pytest.approx(m["chain"]["per_position"][0], abs=1e-4)

    # the registered version resolves to the reduced-vocabulary draft
    draft = resolve_model(f"models:/{cfg.tracking.registered_model}@champion")
    assert torch.equal(draft.token_ids, result.token_ids) and draft.model.lm_head.out_features == len(result.token_ids)
    best = load_file(str(result.job_dir / "best" / "model.safetensors"))  # the export is the best-τ checkpoint
    exported = draft.model.state_dict()
    for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(best[f"draft.{name}"], exported[name]), name
    local = resolve_model(str(isolated_home / "out" / "latest"))
    assert local.path == result.export_dir.resolve() and local.fingerprint == draft.fingerprint
    index = load_suffix_index(draft.path)  # the registered draft carries a suffix index of the train responses
    assert len(index) == result.metrics["train_responses"] and index.num_tokens == result.metrics["train_tokens"]
    # ... and the held-out rank acceptance its trees' node budget is chosen from: p_1 is the greedy agreement α(T=0)
    p = load_rank_acceptance(draft.path)
    assert len(p) == max(TREE_BUDGETS) and p[0] == pytest.approx(result.metrics["alpha_t0"]) and sum(p) <= 1 + 1e-9

    # the HF copy works as transformers' assistant_model: greedy output identical to the target alone
    assistant = AutoModelForCausalLM.from_pretrained(result.export_dir / "hf_assistant").eval()
    prompt = torch.tensor([[1, 10, 11, 12, 13]])
    alone = target.model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assisted = target.model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                     assistant_model=assistant)
    assert torch.equal(alone, assisted)


def test_nan_loss_stops_the_run_and_registers_nothing(isolated_home, monkeypatch):
    cfg = tiny_config(isolated_home, "distill.max_steps=4")
    monkeypatch.setattr("distill.step.distillation_loss", lambda logits, *a, **k: logits.sum() * float("nan"))
    with pytest.raises(NonFiniteLoss, match="nan at step 1"):
        run_distill(cfg)
    assert not (isolated_home / "mlflow.db").exists()
    assert not list((isolated_home / "out").glob("*/draft"))


def test_kill_9_then_resume_matches_an_uninterrupted_run(isolated_home):
    # one precision for both: `auto` is timed per thread count, and the killed run has two threads where pytest has one;
    # a weight average, whose state must come back with the checkpoint for the evaluations to match
    overrides = ("distill.max_steps=24", "distill.eval_every=6", "distill.checkpoint_every=2",
                 "distill.register_model=false", "distill.mixed_precision=no", "distill.ema_decay=0.8")
    killed_cfg = tiny_config(isolated_home, *overrides, f"distill.output_dir={isolated_home}/killed")
    config_file = save_config(killed_cfg, isolated_home / "killed.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "distill.train", "--config", str(config_file)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoints = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        found = list((isolated_home / "killed").glob("*/checkpoints"))
        if found and latest_checkpoint(found[0]) is not None:
            checkpoints = found[0]
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert checkpoints is not None, f"no checkpoint appeared before the run ended: {proc.stderr.read()[-2000:]}"
    killed_at = json.loads((latest_checkpoint(checkpoints) / "trainer_state.json").read_text())["step"]
    assert 2 <= killed_at < 24

    resumed = run_distill(killed_cfg)
    straight = run_distill(tiny_config(isolated_home, *overrides, f"distill.output_dir={isolated_home}/straight"))
    assert [h["step"] for h in resumed.history] == list(range(1, 25))
    torch.testing.assert_close([h["loss"] for h in resumed.history], [h["loss"] for h in straight.history],
                               rtol=1e-6, atol=1e-7)
    assert resumed.evals == straight.evals
    a = load_file(str(resumed.job_dir / "best" / "model.safetensors"))
    b = load_file(str(straight.job_dir / "best" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_match_one_process_with_the_same_global_batch(isolated_home):
    """configs/accelerate/cpu_2proc.yaml really starts 2 ranks, and 2 ranks × batch 2 trace the same loss curve as
    1 process × batch 2 × 2 accumulation steps (same examples per step, token-normalized losses summed over ranks)."""
    common = ("distill.max_steps=6", "distill.batch_size=2", "distill.register_model=false")
    one = run_distill(tiny_config(isolated_home, *common, "distill.grad_accum=2",
                                  f"distill.output_dir={isolated_home}/one"))
    config_file = save_config(tiny_config(isolated_home, *common, f"distill.output_dir={isolated_home}/two"),
                              isolated_home / "two.yaml")
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch",
         "--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
         "--main_process_port", str(free_port()), "-m", "distill.train", "--config", str(config_file)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    # both ranks write to this stderr; the first failure's traceback is usually well before the launcher's summary
    assert launched.returncode == 0, launched.stderr[-12000:]
    assert "2 process(es)" in launched.stdout  # accelerate saw a world of 2 gloo ranks
    two = json.loads(next((isolated_home / "two").glob("*/result.json")).read_text())
    # only the float summation order differs
    torch.testing.assert_close([h["loss"] for h in two["history"]], [h["loss"] for h in one.history],
                               rtol=1e-5, atol=1e-7)
    assert [e["alpha_t1"] for e in two["evals"]] == pytest.approx([e["alpha_t1"] for e in one.evals], abs=1e-5)


def test_online_teacher_and_on_policy_batches(isolated_home):
    from distill.init import init_draft
    from pipeline.config import DistillConfig
    from pipeline.sources import resolve_model

    online = run_distill(tiny_config(isolated_home, "distill.max_steps=3", "distill.teacher=online",
                                     "distill.loss=jsd", "distill.register_model=false"))
    assert len(online.history) == 3 and all(h["loss"] > 0 for h in online.history)
    mixed = run_distill(tiny_config(isolated_home, "distill.max_steps=6", "distill.onpolicy_fraction=0.5",
                                    "distill.loss=tvd", "distill.register_model=false"))
    flags = [h["onpolicy"] for h in mixed.history]
    assert any(flags) and not all(flags)  # seeded per step: a reproducible mix
    assert all(0 < h["loss"] < 1 for h in mixed.history)  # TVD lies in [0, 1]

    # a reduced-vocabulary draft samples only ids of its vocabulary, and gets its own head back afterwards
    target = resolve_model(tiny_config(isolated_home).target)
    token_ids = online.token_ids
    reduced = init_draft(DistillConfig(init_layers=[0]), target.model, token_ids=token_ids)
    sampled = draft_continuations(reduced, target.tokenizer, [[1, 10, 11], [1, 12]], token_ids=token_ids,
                                  max_new_tokens=8, temperature=1.0, seed=0)
    assert all(t in set(token_ids.tolist()) for r in sampled.response_ids for t in r)
    assert isinstance(reduced.lm_head, torch.nn.Linear) and reduced.training


def test_init_only_exports_the_untrained_draft_and_registers_nothing(isolated_home):
    from distill.init import init_draft
    from pipeline.sources import resolve_model

    cfg = tiny_config(isolated_home)
    result = run_distill(cfg, init_only=True)
    assert result.export_dir.name == "init" and result.history == [] and result.version is None
    assert not (isolated_home / "mlflow.db").exists()
    exported = resolve_model(str(result.export_dir), device="cpu")
    assert exported.token_ids.tolist() == result.token_ids.tolist()
    assert (result.export_dir / "hf_assistant" / "config.json").exists()
    target = resolve_model(cfg.target, device="cpu")
    fresh = init_draft(cfg.distill, target.model, token_ids=result.token_ids)
    for name, tensor in fresh.state_dict().items():  # exactly the initialization: layer 0, the cut head
        torch.testing.assert_close(exported.model.state_dict()[name], tensor)


def test_a_finished_job_is_registered_once_and_not_trained_again(isolated_home, monkeypatch):
    """`make distill` again on a finished job: no training, no second version. A job whose registration failed is
    registered by the next run (or `--register-only`), still without training."""
    from mlflow import MlflowClient

    from distill import register, train

    cfg = tiny_config(isolated_home, "distill.max_steps=4")
    real_register = register.registry.register

    def tracking_down(*args, **kwargs):
        raise RuntimeError("tracking went away")

    monkeypatch.setattr(register.registry, "register", tracking_down)
    with pytest.raises(RuntimeError, match="went away"):
        run_distill(cfg)
    monkeypatch.setattr(register.registry, "register", real_register)
    monkeypatch.setattr(train, "train_loop", lambda *a, **k: pytest.fail("a finished job was trained again"))
    first = run_distill(cfg)  # registers what the failed run exported
    again = run_distill(cfg, register_only=True)
    assert first.version == again.version == "1" and first.export_dir == again.export_dir
    name = cfg.tracking.registered_model
    assert [v.version for v in MlflowClient().search_model_versions(f"name='{name}'")] in (["1"], [1])
    other = tiny_config(isolated_home, "distill.max_steps=5")
    with pytest.raises(train.NothingToRegister, match="nothing to register"):
        run_distill(other, register_only=True)
    # the same finished job against another tracking store (a tracking server after the local sqlite file): it is
    # registered there, once, and the first store keeps its one version
    server = tiny_config(isolated_home, "distill.max_steps=4", f"tracking.uri=sqlite:///{isolated_home}/server.db")
    moved = run_distill(server)
    there = MlflowClient(tracking_uri=server.tracking.uri, registry_uri=server.tracking.uri)
    assert moved.version == "1" and moved.run_id != first.run_id
    assert [v.version for v in there.search_model_versions(f"name='{name}'")] in (["1"], [1])
    assert run_distill(server).run_id == moved.run_id and run_distill(cfg).run_id == first.run_id
    assert [v.version for v in MlflowClient().search_model_versions(f"name='{name}'")] in (["1"], [1])


def test_a_feature_draft_job_exports_the_speculators_format_registers_and_decodes_losslessly(isolated_home,
                                                                                             monkeypatch):
    """family=features end to end on a 4-layer tiny target (3 increasing feature layers): its features recorded as
    the target generates (a teacher-forced pass over the held-out responses alone), trained with training-time test
    and one step of the on-policy stage on its own chains, evaluated by draft position, exported as speculators
    Eagle3, registered, then loaded back from the registry through `load_draft` and decoded greedily: the target's
    own output. A re-run trains nothing."""
    from decode.factory import build_decoder
    from decode.models.feature_draft import FeatureDraft
    from decode.runtime.forward import ModelRunner, greedy_decode
    from decode.serving.loading import load_draft, load_model
    from decode.serving.speculators import is_speculators_dir
    from pipeline.sources import save_checkpoint
    from pipeline.tracking import setup_mlflow
    from tests.conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, isolated_home / "target")
    cfg = tiny_config(isolated_home, "distill.family=features", "distill.ttt_steps=2", "distill.max_steps=4",
                      "decode.gamma=3", "distill.onpolicy_steps=1")
    from distill.data import features

    passes, teacher_forced = [], features.teacher_forced_features
    monkeypatch.setattr(features, "teacher_forced_features",
                        lambda model, sequences, *a, **k: passes.append(len(sequences)) or teacher_forced(
                            model, sequences, *a, **k))
    result = run_distill(cfg)
    # one teacher-forced pass in the job: the held-out responses', for every evaluation; none over the training set
    assert len(passes) == 1 and passes[0] < result.metrics["train_responses"]
    assert result.version == "1" and is_speculators_dir(result.export_dir)
    assert [h["stage"] for h in result.history] == ["epochs"] * 4 + ["chains"]
    assert {f"alpha_t0_pos{j}" for j in (1, 2, 3)} <= set(result.metrics) and result.metrics["tau_t0"] >= 1
    chain = result.metrics["chain"]  # chains of 3 as vLLM counts them, with the length's interval
    assert chain["k"] == 3 and chain["length_low"] <= chain["length"] <= chain["length_high"] <= 4
    assert result.metrics["alpha_t0_low"] <= result.metrics["alpha_t0"] <= result.metrics["alpha_t0_high"]
    p = load_rank_acceptance(result.export_dir)  # its first draft position's, for its EAGLE-2 trees
    assert len(p) == max(TREE_BUDGETS) and 0 < sum(p) <= 1 + 1e-9
    setup_mlflow(cfg)
    target = load_model(cfg.target, device="cpu", cpu_linear="torch")
    draft = load_draft(f"models:/{cfg.tracking.registered_model}@champion", target, cpu_linear="torch")
    assert isinstance(draft.model, FeatureDraft) and draft.model.feature_layers == (1, 2, 3)
    decoder = build_decoder(target, draft, cfg.decode)
    prompt = target.tokenizer("the cat sat on", add_special_tokens=False)["input_ids"]
    expected = greedy_decode(ModelRunner(target.model), prompt, 16, decoder.eos_token_ids)
    assert decoder.generate(prompt, max_new_tokens=16).token_ids == expected
    again = run_distill(cfg)
    assert again.version == "1" and again.history == result.history


@pytest.mark.parametrize("family", ["layers", "features"])
def test_beside_a_bfloat16_target_drafts_train_and_export_float32_weights(isolated_home, family):
    """What `dtype: auto` gives on a GPU, here on a CPU: a bfloat16 target, bf16 mixed precision. The draft's own
    weights are float32 master weights from init to export (the export once came out rounded to bfloat16), and a
    feature draft's embeddings, shared with the target, stay bfloat16 (once cast with the draft, the target's own
    forward mixed float32 embeddings into bfloat16 layers and the first evaluation failed)."""
    from pipeline.sources import save_checkpoint
    from tests.conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, isolated_home / "target")
    cfg = tiny_config(isolated_home, f"distill.family={family}", "distill.ttt_steps=2", "decode.gamma=3",
                      "distill.max_steps=4", "distill.register_model=false", "dtype=bfloat16",
                      "distill.mixed_precision=bf16")
    result = run_distill(cfg)
    assert len(result.evals) == 1 and torch.isfinite(torch.tensor([h["loss"] for h in result.history])).all()
    floats = {w.dtype for w in load_file(str(result.export_dir / "model.safetensors")).values()
              if w.is_floating_point()}
    assert floats == {torch.float32}


def test_the_summary_points_at_the_export_for_vllm_and_llama_cpp(isolated_home, capsys):
    cfg = tiny_config(isolated_home)
    draft = isolated_home / "out" / "job" / "draft"
    metrics_ = {"best_step": 4, "alpha_t0": 0.5, "alpha_t1": 0.4, "tau_t0": 1.8, "tau_t1": 1.6}
    print_summary(cfg, DistillResult(draft, draft.parent, metrics_, [], [], {"training": 3.0}, None, "fp"))
    assert (f"  to serve:     draftops export {draft} --format vllm|gguf --out DIR  (vLLM; gguf: llama.cpp)"
            in capsys.readouterr().out)
    print_summary(cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"family": "features"})}),
                  DistillResult(draft, draft.parent, metrics_, [], [], {"training": 3.0}, None, "fp"))
    assert f"  to serve:     draftops export {draft} --format vllm --out DIR" in capsys.readouterr().out


def test_a_size_family_trains_one_job_per_layer_count_and_registers_each_under_its_size(isolated_home):
    from mlflow import MlflowClient

    from pipeline.sources import resolve_model
    from pipeline.tracking import setup_mlflow

    cfg = tiny_config(isolated_home, "distill.max_steps=4")
    champion = run_distill(cfg)  # the plain job: 1 layer in the tiny config
    family = run_sizes(cfg, [1, 2])
    assert family[0].job_dir == champion.job_dir and family[0].version == champion.version == "1"  # not trained again
    assert family[1].version == "2" and family[1].alias == "layers-2" and family[1].job_dir != champion.job_dir
    assert len(family[1].history) == len(champion.history) == 4  # one budget
    setup_mlflow(cfg)
    name = cfg.tracking.registered_model
    assert MlflowClient().get_registered_model(name).aliases == {"champion": 1, "layers-1": 1, "layers-2": 2}
    assert MlflowClient().get_model_version(name, "2").tags[metrics.DRAFT_LAYERS] == "2"
    assert resolve_model(f"models:/{name}@layers-2").model.config.num_hidden_layers == 2


def test_size_family_arguments_are_checked():
    assert layer_counts("4,1,2,2") == [1, 2, 4]
    for bad in ("0,2", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            layer_counts(bad)
    with pytest.raises(ValueError, match="family=layers"):
        sizes_config(load_config(None, ["distill.family=features"]), 2)
    assert sizes_config(load_config(None, ["distill.family=layers"]), 3).distill.init_layers == [0, 1, 2]


def test_the_job_key_follows_what_training_reads_and_not_later_decoding():
    from distill.checkpoints import job_key

    base = job_key(load_config(None), "data")
    # decoding and monitoring settings training does not read leave a finished job found
    for override in ("decode.lookup_min_ngram=3", "decode.tree_budget=8", "decode.max_new_tokens=64",
                     "monitor.level=0.01", "target_update.lora_last_layers=4", "distill.checkpoint_every=7"):
        assert job_key(load_config(None, [override]), "data") == base, override
    # what the weights or the kept checkpoint depend on makes another job
    for override in ("decode.gamma=3", "decode.temperature=1.0", "distill.init_layers=[0]", "seed=1",
                     "traffic.heldout_fraction=0.2"):
        assert job_key(load_config(None, [override]), "data") != base, override
    assert job_key(load_config(None), "other data") != base


# --------------------------------------------------------------------------- every family
# Drafts from every supported family (tests.families: random weights, built from transformers' configs): the layer
# draft and the feature draft distilled for two steps, evaluated, registered, decoded greedily as the target alone
# decodes (chains and token trees), and exported in every format that applies, each loaded back. One module-scoped
# job pair per family (one MLflow store for all).

@pytest.fixture(scope="module", params=FAMILIES)
def jobs(request, tmp_path_factory, _migrated_mlflow_db):
    """A random-weight target of the family, and a layer draft and a feature draft distilled from it for two steps
    (responses generated once), each evaluated and registered in one shared MLflow store."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    store = tmp_path_factory.getbasetemp() / "families-mlflow.db"
    if not store.exists():
        shutil.copy(_migrated_mlflow_db, store)
    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(tiny_family(family, vocab_size=len(tokenizer), dtype=torch.float32), tokenizer, root / "target")
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTOPS_HOME", str(root / "home"))
        torch.set_num_threads(1)
        for kind in ("layers", "features"):
            cfg = tiny_config(root, f"distill.family={kind}", "distill.max_steps=2", "distill.eval_every=2",
                              "distill.ttt_steps=2", "decode.gamma=3", "distill.responses_per_prompt=1",
                              "distill.max_new_tokens=8", "distill.eval_prompts=4", f"tracking.uri=sqlite:///{store}",
                              f"tracking.registered_model=draft-{family}-{kind}", f"distill.output_dir={root}/{kind}")
            reset_accelerate_state()  # the layer draft's job may have timed bf16 the faster, the feature draft's not
            results[kind] = (cfg, run_distill(cfg))
    return {"family": family, "root": root, "tokenizer": tokenizer, **results}


def check_job(cfg, result, family: str) -> None:
    assert len(result.history) == 2 and [e["step"] for e in result.evals] == [2]
    assert torch.isfinite(torch.tensor([h["loss"] for h in result.history])).all()
    assert 0 <= result.metrics["alpha_t0"] <= 1 and result.metrics["tau_t0"] >= 1
    assert (result.version, result.alias) == ("1", "champion"), family


def greedy_identity(cfg, source: str, *, trees: bool) -> None:
    """The draft loaded back (as `draftops decode` loads it) decodes, in chains or in token trees, the target's greedy
    output."""
    target = load_model(cfg.target, device="cpu", cpu_linear="torch")
    draft = load_draft(source, target, cpu_linear="torch")
    prompt = target.tokenizer("the cat sat on", add_special_tokens=False)["input_ids"]
    decode = DecodeConfig(gamma=3, suffix=False, **{"tree_budget": 6} if trees else {"tree_budget_schedule": None})
    decoder = build_decoder(target, draft, decode)
    expected = greedy_decode(ModelRunner(target.model), prompt, 12, decoder.eos_token_ids)
    assert decoder.generate(prompt, max_new_tokens=12).token_ids == expected


def test_both_distilled_drafts_decode_the_targets_greedy_output_in_token_trees(jobs):
    for kind in ("layers", "features"):
        cfg, result = jobs[kind]
        greedy_identity(cfg, str(result.export_dir), trees=True)


@torch.no_grad()
def test_a_layer_draft_distills_decodes_and_exports_as_hf_vllm_and_gguf(jobs, tmp_path):
    family, (cfg, result) = jobs["family"], jobs["layers"]
    check_job(cfg, result, family)
    assert result.token_ids is not None  # a reduced head, exported with its full-vocabulary copy
    greedy_identity(cfg, str(result.export_dir), trees=False)
    vocab, source = len(jobs["tokenizer"]), draft_source(str(result.export_dir))
    kept = load_checkpoint(result.export_dir).eval()(SEQ).logits
    for fmt in (HF, VLLM):
        out = export_format(source, fmt, tmp_path / fmt, target_vocab_size=vocab)
        assert json.loads((out / "config.json").read_text())["model_type"] == kept_type(family)
        full = AutoModelForCausalLM.from_pretrained(out).eval()(SEQ).logits
        torch.testing.assert_close(full[..., result.token_ids], kept, atol=1e-5, rtol=1e-5)
    vocabulary = vocabulary_gguf(tmp_path / "target.gguf", jobs["tokenizer"].convert_ids_to_tokens(range(vocab)))
    if family == "llama":  # read back through transformers' GGUF loader inside, to the copy's logits
        out = export_format(source, GGUF, tmp_path / "gguf", vocabulary=vocabulary, gguf_dtype="f32")
        assert [p.name for p in out.iterdir()] == ["draft-f32.gguf"]
    else:
        why = "rotary scaling 'llama3'" if family == "llama3" else f"model type '{kept_type(family)}'"
        with pytest.raises(ExportError, match=why):
            export_format(source, GGUF, tmp_path / "gguf", vocabulary=vocabulary)
        assert not (tmp_path / "gguf").exists()


def kept_type(family: str) -> str:
    return {"llama3": "llama", "gemma3": "gemma3_text"}.get(family, family)


@torch.no_grad()
def test_a_feature_draft_distills_decodes_and_exports_as_speculators_and_vllm(jobs, tmp_path):
    """The speculators folder loads back into draftops and into `speculators` itself, which computes the same
    training-time-test logits over the target's features."""
    speculators = pytest.importorskip("speculators")
    family, (cfg, result) = jobs["family"], jobs["features"]
    check_job(cfg, result, family)
    greedy_identity(cfg, str(result.export_dir), trees=False)
    target = AutoModelForCausalLM.from_pretrained(cfg.target).eval()
    ours = load_speculators(result.export_dir, target)
    assert isinstance(ours, FeatureDraft) and ours.feature_layers == (1, 2, 3)
    source = draft_source(str(result.export_dir))
    for fmt in (SPECULATORS, VLLM):
        export_format(source, fmt, tmp_path / fmt, target_vocab_size=len(jobs["tokenizer"]))
    with pytest.raises(ExportError, match="feature draft"):
        export_format(source, HF, tmp_path / "hf")
    layer = json.loads((tmp_path / VLLM / "config.json").read_text())["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"]) == ("llama", 1)

    config = speculators.Eagle3SpeculatorConfig.from_pretrained(tmp_path / SPECULATORS)
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = speculators.SpeculatorModel.from_pretrained(tmp_path / SPECULATORS, config=config).eval()
    theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # as tests/decode/test_speculators_format
    logits = []
    theirs.lm_head.register_forward_hook(lambda module, args, output: logits.append(output[0]))
    seq = SEQ[:1]
    features = target_features(target(input_ids=seq, output_hidden_states=True).hidden_states, ours.feature_layers)
    input_ids = torch.cat([seq[0, 1:], seq.new_zeros(1)])[None]  # index i reads token i + 1, as in FeatureDraft
    theirs(hidden_states=features, input_ids=input_ids, document_ids=torch.zeros_like(input_ids), ttt_steps=2)
    unrolled = ours.unroll(features, seq, torch.ones_like(seq), 2)
    for hidden, their in zip(unrolled, logits, strict=True):
        torch.testing.assert_close(their, ours.logits(hidden)[0], atol=1e-4, rtol=1e-4)


def test_jobs_of_different_timed_precision_run_in_one_process():
    """A size family or the monitor's retraining runs several jobs in one process, and `mixed_precision: auto` times
    each draft shape afresh: a later job's precision may differ from an earlier one's, which accelerate's one state
    per process would refuse."""
    cfg = load_config(None, ["device=cpu"])
    assert make_accelerator(cfg, "no").mixed_precision == "no"
    later = make_accelerator(cfg, "bf16").mixed_precision
    assert later in ("bf16", "no") and AcceleratorState().mixed_precision == later


def test_acceptance_loss_muon_and_a_frozen_head_train(isolated_home):
    """The acceptance objective under Muon + AdamW on a linear schedule, the head's rows kept as the target's, then
    the on-policy stage on the draft's own chains."""
    cfg = tiny_config(isolated_home, "distill.max_steps=3", "distill.loss=log_acceptance", "distill.optimizer=muon",
                      "distill.lr_schedule=linear", "distill.train_head=false", "distill.register_model=false",
                      "distill.onpolicy_steps=2")
    result = run_distill(cfg)
    assert [h["stage"] for h in result.history] == ["epochs"] * 3 + ["chains"] * 2
    assert all(torch.isfinite(torch.tensor(h["loss"])) and h["loss"] > 0 for h in result.history)
    target = load_model(cfg.target, device="cpu", dtype="float32")
    draft = load_draft(str(result.export_dir), target)
    head = target.model.get_output_embeddings().weight[draft.token_ids]
    torch.testing.assert_close(draft.model.get_output_embeddings().weight, head)
