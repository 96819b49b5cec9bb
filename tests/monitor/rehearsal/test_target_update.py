"""`draftops target finetune` on a tiny target: restyled SFT data, LoRA that moves the weights, merge,
a new checkpoint."""
import json

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from monitor.rehearsal.target_update import (
    MARKER_FILE,
    lora_finetune,
    response_loss,
    restyle,
    run_finetune,
    sft_batch,
    styled_examples,
)
from pipeline.cli import main as draftops
from pipeline.config import TargetUpdateConfig
from pipeline.sources import resolve_model
from pipeline.traffic import encode_prompts, load_traffic
from tests.conftest import make_tiny_model
from tests.distill.tiny_job import tiny_config


def test_restyle():
    assert restyle("Hello, world.", TargetUpdateConfig(style="uppercase")) == "HELLO, WORLD."
    assert restyle("  the answer", TargetUpdateConfig(style="prefix", prefix="please")) == "please the answer"


def test_styled_examples_keep_the_stop_token_and_fit_the_length(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    hello, world = tiny_tokenizer.convert_tokens_to_ids(["hello", "world"])
    cfg = TargetUpdateConfig(style="prefix", prefix="please", max_seq_tokens=16)
    please = tiny_tokenizer.convert_tokens_to_ids("please")
    p13, p14 = [5] * 13, [6] * 14
    examples = styled_examples(tiny_tokenizer, [p13, p13, p13], [[hello, eos], [world], [eos]], [eos], cfg)
    assert examples == [(p13, [please, hello, eos]), (p13, [please, world])]  # an empty response is dropped
    cut = styled_examples(tiny_tokenizer, [p14], [[hello, world, eos]], [eos], cfg)
    assert cut == [(p14, [please, hello])]


def test_sft_batch_labels_only_the_response():
    batch = sft_batch([([7, 8], [9, 2]), ([7], [3])], pad_id=0, device="cpu")
    assert batch["input_ids"].tolist() == [[7, 8, 9, 2], [7, 3, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 9, 2], [-100, 3, -100, -100]]


def test_response_loss_is_the_causal_lm_loss_on_the_response():
    model = make_tiny_model(50, seed=0)
    batch = sft_batch([([7, 8, 9], [10, 11, 2]), ([7], [12, 2])], pad_id=0, device="cpu")
    expected = model(**batch).loss  # transformers shifts the labels and skips -100
    assert response_loss(model, batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_lora_on_the_last_layers_leaves_the_others_alone():
    model = make_tiny_model(50, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    examples = [([7, 8, 9], [10, 11, 2]), ([7, 9], [12, 2]), ([8], [13, 14, 2])]
    cfg = TargetUpdateConfig(steps=3, batch_size=2, lora_last_layers=1, lora_r=2, lora_alpha=4, learning_rate=0.01)
    merged, losses = lora_finetune(model, examples, cfg, pad_id=0, seed=0)
    after = merged.state_dict()
    assert set(after) == set(before) and len(losses) == 3
    for name in before:
        moved = not torch.equal(before[name], after[name])
        adapted = name.startswith("model.layers.1.") and name.endswith("proj.weight")
        assert moved == adapted, name


def test_finetune_makes_a_new_target_checkpoint(tmp_path, capsys):
    cfg = tiny_config(tmp_path, f"target_update.output_dir={tmp_path}/target-v2", "target_update.steps=12",
                      "target_update.learning_rate=0.01", "target_update.lora_r=4", "target_update.lora_alpha=8")
    base = resolve_model(cfg.target, device="cpu")
    result = run_finetune(cfg)
    assert result.path == tmp_path / "target-v2" and result.base_fingerprint == base.fingerprint
    assert result.fingerprint != base.fingerprint and len(result.losses) == 12
    assert result.losses[-1] < result.losses[0]
    updated = resolve_model(str(result.path), device="cpu")
    assert updated.fingerprint == result.fingerprint and updated.token_ids is None
    # merged: a plain Llama again, no adapter modules left; the adapted projections moved, embeddings did not
    assert not any("lora" in name for name in updated.model.state_dict())
    before, after = base.model.state_dict(), updated.model.state_dict()
    assert set(before) == set(after)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                           after["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    # the style moved: upper-cased words are not in the word-level vocabulary, so ALL CAPS responses are [UNK]
    # tokens, and the new target puts much more mass on [UNK] after a prompt (a tiny tied head stays flat: ~1/90)
    requests = load_traffic(cfg.traffic.path).requests[:8]
    prompts, _ = encode_prompts(requests, base.tokenizer, 64)
    unk = base.tokenizer.unk_token_id

    def p_unk(model):
        return sum(torch.softmax(model(torch.tensor([p])).logits[0, -1], -1)[unk].item() for p in prompts) / 8

    with torch.no_grad():
        assert p_unk(updated.model) > 3 * p_unk(base.model)
    lineage = json.loads((result.path / MARKER_FILE).read_text())
    assert lineage["base_fingerprint"] == base.fingerprint and lineage["style"] == "uppercase"
    assert (result.path / "draftops_config.yaml").exists()
    run = MlflowClient().get_run(result.run_id)
    assert mlflow.get_experiment(run.info.experiment_id).name == "draftops-target"
    assert run.data.tags["draftops.target_fingerprint"] == result.fingerprint
    assert run.data.tags["draftops.base_target_fingerprint"] == base.fingerprint
    assert run.data.metrics["train/final_loss"] == pytest.approx(result.losses[-1])
    assert [m.value for m in MlflowClient().get_metric_history(result.run_id, "train/loss")] == pytest.approx(
        result.losses)

    # the CLI: a second run replaces its own earlier output; a foreign folder is refused
    assert draftops(["target", "finetune", f"target={cfg.target}", f"traffic.path={cfg.traffic.path}", "device=cpu",
                     "traffic.heldout_fraction=0.25", "distill.responses_per_prompt=2", "distill.max_new_tokens=12",
                     f"target_update.output_dir={result.path}", "target_update.steps=2", "target_update.lora_r=2",
                     "target_update.lora_alpha=4"]) == 0
    out = capsys.readouterr().out
    assert f"-> {result.path}" in out and f"monitor check target={result.path}" in out
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an earlier"):
        run_finetune(cfg.model_copy(update={"target_update": cfg.target_update.model_copy(
            update={"output_dir": str(foreign), "steps": 1})}))
    assert (foreign / "keep.txt").read_text() == "mine"


def test_prompts_are_distills_train_split_or_a_file(tmp_path):
    from monitor.rehearsal.target_update import prompt_requests
    from pipeline.traffic import load_traffic

    cfg = tiny_config(tmp_path, "target_update.max_prompts=5")
    train = load_traffic(cfg.traffic.path).split("train", cfg.traffic.heldout_fraction)
    assert [r.id for r in prompt_requests(cfg)] == [r.id for r in train]  # whole: distill's cache entry
    limited = tiny_config(tmp_path, "distill.train_prompts=7")
    assert [r.id for r in prompt_requests(limited)] == [r.id for r in train[:7]]
    from_file = tiny_config(tmp_path, f"target_update.prompts={cfg.traffic.path}", "target_update.max_prompts=5")
    assert [r.id for r in prompt_requests(from_file)] == [f"r{i:03d}" for i in range(5)]  # any split, in file order
