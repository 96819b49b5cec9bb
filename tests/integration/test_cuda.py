"""The same code on a GPU: lossless decoding (chains, trees, prompt lookup, feature drafts, compiled passes, bf16),
sampling's distribution, and distill's job (bf16 mixed precision, both draft families, the FSDP accelerate config) on
CUDA. Skipped where torch sees no CUDA device; `make test-cuda` runs them (CI has no GPU)."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from decode.drafters.tree_drafter import make_tree_drafter
from decode.factory import model_decoder
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.lean import use_compiled_passes
from tests.decode.models.test_feature_draft import make_feature_draft
from tests.decode.tiny import greedy_reference, perturbed_copy, tiny_llama
from tests.lossless.test_drafts_and_families import T1, check_first_two

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = ([5, 9, 2, 77, 3, 9, 2, 77], [1, 7], [3])


def on_gpu(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    return copy.deepcopy(model).to(CUDA, dtype)


@torch.inference_mode()
@pytest.mark.parametrize("rounds", ["chain", "lookup-first chain", "tree", "tree with lookup"])
def test_greedy_decoding_on_cuda_is_the_targets_own(rounds):
    """float64 on the GPU as in the CPU tests: the output equals the target alone decoded without a cache on the
    CPU, token for token."""
    target = tiny_llama(2)
    draft = perturbed_copy(target, seed=11, noise=0.05)
    options = {"chain": {}, "lookup-first chain": {"lookup_min_ngram": 1}, "tree": {"tree_budget": 6},
               "tree with lookup": {"tree_budget": 6, "lookup_min_ngram": 1}}[rounds]
    decoder = model_decoder(on_gpu(target), on_gpu(draft), 4, **options)
    for prompt in PROMPTS:
        result = decoder.generate(prompt, max_new_tokens=40)
        assert result.token_ids == greedy_reference(target, prompt, 40)
        assert result.stats.accepted > 0


@torch.inference_mode()
@pytest.mark.parametrize("tree", [False, True])
def test_a_feature_draft_on_cuda_decodes_the_targets_own_tokens(tree):
    from tests.conftest import make_tiny_model

    target = make_tiny_model(40, seed=3, layers=4)
    draft = make_feature_draft(target, token_ids=torch.arange(0, 40, 2))
    target.to(CUDA), draft.to(CUDA)  # in place: the draft shares the target's embeddings
    drafter = make_tree_drafter("draft", target, draft, budget=6, branching=3) if tree else draft
    decoder = model_decoder(target, drafter, 3, eos_token_ids=())
    runner = ModelRunner(target)
    for prompt in ([1, 5, 9, 3], [1, 7], [1]):
        assert decoder.generate(prompt, max_new_tokens=20).token_ids == greedy_decode(runner, prompt, 20)


@torch.inference_mode()
def test_compiled_passes_on_cuda_decode_what_the_eager_ones_do():
    """inductor's Triton kernels (`decode.runtime.compiled_pass.compile_options` gives a GPU no CPU options) for target
    and draft, float32, chains and trees."""
    target, draft = on_gpu(tiny_llama(2), torch.float32), on_gpu(tiny_llama(3), torch.float32)
    prompt = PROMPTS[0]
    expected = [model_decoder(target, draft, 4, tree_budget=budget).generate(prompt, max_new_tokens=30).token_ids
                for budget in (0, 3)]
    use_compiled_passes(target)
    use_compiled_passes(draft)
    compiled = [model_decoder(target, draft, 4, tree_budget=budget) for budget in (0, 3)]
    assert [d.generate(prompt, max_new_tokens=30).token_ids for d in compiled] == expected


def bfloat16_spacing(value: float) -> float:
    """The gap between neighbouring bfloat16 numbers (8 significant bits) around `value`."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


@torch.inference_mode()
def test_bfloat16_on_cuda_decodes_what_one_token_steps_give_up_to_near_ties():
    """bfloat16 target and draft: the decoder's tokens are those of one-token greedy steps through the same forward,
    except where a verify pass of several tokens rounds differently from a one-token step: from the first token
    where they part, the two candidates' logits (in float32, from the same weights) lie within four bfloat16 steps
    of each other. This is why greedy identity is checked in float32 everywhere else."""
    target = on_gpu(tiny_llama(2), torch.bfloat16)
    draft = on_gpu(perturbed_copy(tiny_llama(2), seed=11, noise=0.05), torch.bfloat16)
    reference = copy.deepcopy(target).float()
    runner = ModelRunner(target)
    identical = 0
    for budget in (0, 6):
        decoder = model_decoder(target, draft, 4, tree_budget=budget)
        for prompt in PROMPTS:
            ours, steps = decoder.generate(prompt, max_new_tokens=40).token_ids, greedy_decode(runner, prompt, 40)
            if ours == steps:
                identical += 1
                continue
            i = next(k for k, (a, b) in enumerate(zip(ours, steps)) if a != b)
            logits = reference(torch.tensor([prompt + ours[:i]], device=CUDA)).logits[0, -1]
            gap = abs(float(logits[ours[i]] - logits[steps[i]]))
            assert gap <= 4 * bfloat16_spacing(float(logits.max())), (budget, prompt, i, gap)
    assert identical >= 1


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_on_cuda_keeps_the_targets_distribution(tree):
    """The chi-square test of tests/lossless/test_drafts_and_families.py with the decoder on the GPU (its own random
    numbers) and the exact distribution from the same float64 target on the CPU."""
    target = tiny_llama(10, vocab_size=16, init_range=0.15)
    draft = perturbed_copy(target, seed=11, noise=0.15)
    decoder = model_decoder(on_gpu(target), on_gpu(draft), 2, tree_budget=6 if tree else 0, tree_branching=3)
    stats = check_first_two(target, decoder, [3], T1)
    assert sum(s.accepted for s in stats) > 500


def distill_on_cuda(root: Path, *overrides: str):
    from distill.train import run_distill
    from tests.distill.tiny_job import tiny_config

    cfg = tiny_config(root, "device=cuda", "distill.mixed_precision=bf16", "distill.max_steps=8",
                      "distill.register_model=false", *overrides)
    return cfg, run_distill(cfg)


def test_distill_on_cuda_trains_in_bfloat16_mixed_precision_and_exports_fp32_weights(tmp_path, capsys):
    from safetensors.torch import load_file

    cfg, result = distill_on_cuda(tmp_path)
    assert "process(es) on cuda" in capsys.readouterr().out
    losses = torch.tensor([h["loss"] for h in result.history])
    assert len(losses) == 8 and torch.isfinite(losses).all() and losses[-1] < losses[0]
    assert [e["step"] for e in result.evals] == [4, 8] and 0 < result.metrics["alpha_t1"] <= 1
    weights = load_file(str(result.export_dir / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}  # master weights, not the bf16 compute copies


def test_a_feature_draft_job_on_cuda_exports_a_draft_that_decodes_losslessly(tmp_path):
    from decode.factory import build_decoder
    from decode.serving.loading import load_draft, load_model
    from pipeline.sources import save_checkpoint
    from tests.conftest import make_tiny_model, make_tokenizer

    tokenizer = make_tokenizer(extra_words=40)
    save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, tmp_path / "target")
    cfg, result = distill_on_cuda(tmp_path, "distill.family=features", "distill.ttt_steps=2", "decode.gamma=3")
    assert {f"alpha_t0_pos{j}" for j in (1, 2, 3)} <= set(result.metrics)
    target = load_model(cfg.target, device="cuda", dtype="float32")
    draft = load_draft(str(result.export_dir), target)
    decoder = build_decoder(target, draft, cfg.decode)
    prompt = target.tokenizer("the cat sat on", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        expected = greedy_decode(ModelRunner(target.model), prompt, 16, decoder.eos_token_ids)
        assert decoder.generate(prompt, max_new_tokens=16).token_ids == expected


@pytest.mark.parametrize("precision,rtol", [("no", 1e-4), ("bf16", 5e-2)])
def test_the_fsdp_config_runs_the_whole_job_on_the_gpus(tmp_path, precision, rtol):
    """configs/accelerate/fsdp.yaml as shipped, but one process per visible GPU: accelerate turns FSDP2 on, the job
    trains, evaluates through the sharded draft, gathers it and exports it, tracing one process's loss curve (in
    float32 to the summation order; in bf16 mixed precision, FSDP's and autocast's roundings differ)."""
    from pipeline.config import save_config
    from tests.distill.test_train import free_port
    from tests.distill.tiny_job import tiny_config

    accelerate_config = yaml.safe_load((REPO / "configs/accelerate/fsdp.yaml").read_text())
    accelerate_config["num_processes"] = torch.cuda.device_count()
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(accelerate_config))
    common = (f"distill.mixed_precision={precision}", "distill.max_steps=6")
    cfg = tiny_config(tmp_path, "device=cuda", "distill.register_model=false", *common,
                      f"distill.output_dir={tmp_path}/fsdp")
    alone = tiny_config(tmp_path, "device=cuda", "distill.register_model=false", *common,
                        f"distill.output_dir={tmp_path}/alone")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp.yaml"),
                "--main_process_port", str(free_port())]
    histories, printed = [], []
    for job, prefix in ((cfg, launcher), (alone, [sys.executable])):  # each job in a process of its own
        launched = subprocess.run(
            [*prefix, "-m", "distill.train", "--config", str(save_config(job, tmp_path / "job.yaml"))],
            cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
        assert launched.returncode == 0, launched.stderr[-12000:]
        printed.append(launched.stdout)
        histories.append(json.loads(next(Path(job.distill.output_dir).glob("*/result.json")).read_text())["history"])
    assert "distributed as FSDP" in printed[0] and "distributed as" not in printed[1], printed
    sharded, one = histories
    assert [h["step"] for h in sharded] == [h["step"] for h in one]
    torch.testing.assert_close([h["loss"] for h in sharded], [h["loss"] for h in one], rtol=rtol, atol=1e-6)
    exported = next((tmp_path / "fsdp").glob("*/best/model.safetensors"))
    assert exported.stat().st_size > 0
