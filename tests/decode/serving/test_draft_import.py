"""Drafts made elsewhere (`draftops models import`, decode.serving.draft_import): a speculators Eagle3 folder and
EAGLE's own EAGLE-3 checkpoint are checked against the target, registered with their provenance, and then go through
`monitor check`, bench and export like a distilled draft, and can be a feature draft job's starting point."""
from __future__ import annotations

import json

import mlflow
import pytest
import torch
import yaml
from safetensors.torch import save_file

from decode.models.feature_draft import feature_draft_from_target
from decode.serving.draft_import import EAGLE, SPECULATORS, HeadImportError, head_layout, import_head
from decode.serving.loading import load_draft, load_model
from decode.serving.speculators import save_speculators, vocab_maps
from pipeline import metrics as M
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from tests.conftest import WORDS, make_tiny_model, make_tokenizer

NAME = "draftops-draft"


@pytest.fixture
def world(tmp_path, mlflow_uri):
    """A 4-layer tiny target, traffic, a config file, and a trained-looking feature draft made "elsewhere"."""
    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, tmp_path / "target")
    traffic = tmp_path / "traffic.jsonl"
    with open(traffic, "w") as f:
        for i in range(40):
            words = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))
            f.write(json.dumps({"id": f"q{i}", "category": "chat", "prompt": words}) + "\n")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "target": str(target), "device": "cpu", "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        "decode": {"max_new_tokens": 6, "gamma": 3},
        "monitor": {"heldout_requests": 8, "state_dir": str(tmp_path / "state"), "n_bootstrap": 200,
                    "break_even_alpha": 0.0}}))
    model = load_model(str(target), device="cpu", cpu_linear="torch")
    head = feature_draft_from_target(model.model, torch.tensor(sorted({0, 1, 2, *range(5, len(tokenizer), 2)})))
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if not name.startswith("embed_tokens"):
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    return target, path, model, head.eval()


def eagle_checkpoint(head, target_config, folder):
    """`head` in EAGLE-3's own layout: a Llama config with draft_vocab_size, `midlayer.*`, d2t/t2d."""
    folder.mkdir()
    weights = {name.replace("layers.0.", "midlayer."): value.contiguous() for name, value in head.state_dict().items()
               if name != "embed_tokens.weight"}
    weights["d2t"], weights["t2d"] = vocab_maps(head.token_ids, target_config.vocab_size)
    save_file(weights, folder / "model.safetensors")
    config = {key: getattr(target_config, key) for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                           "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                                           "max_position_embeddings", "head_dim")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, hidden_act="silu",
                  draft_vocab_size=len(head.token_ids), tie_word_embeddings=False, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@torch.no_grad()
def unrolled_logits(draft, target, ids):
    from decode.runtime.forward import target_features

    features = target_features(target(input_ids=ids, output_hidden_states=True).hidden_states, draft.feature_layers)
    return [draft.logits(h) for h in draft.unroll(features, ids, torch.ones_like(ids), 3)]


def test_both_layouts_import_computing_what_the_head_computed(world, tmp_path):
    target_dir, cfg_path, target, head = world
    cfg = load_config(cfg_path)
    exported = save_speculators(head, tmp_path / "exported", verifier_name_or_path=str(target_dir))
    eagle = eagle_checkpoint(head, target.model.config, tmp_path / "eagle")
    assert (head_layout(exported), head_layout(eagle)) == (SPECULATORS, EAGLE)
    ids = torch.tensor([[1, 5, 9, 3, 7, 7, 4, 12]])
    for source, layout in ((exported, SPECULATORS), (eagle, EAGLE)):
        imported = import_head(source, target, tmp_path / f"imported-{layout}", cfg)
        assert imported.layout == layout and (imported.path / "imported.json").is_file()
        assert any("maps text to the target's ids" in c for c in imported.checks) == (layout == SPECULATORS)
        again = load_draft(str(imported.path), target, cpu_linear="torch").model
        assert torch.equal(again.token_ids, head.token_ids) and again.feature_layers == head.feature_layers
        for ours, theirs in zip(unrolled_logits(head, target.model, ids), unrolled_logits(again, target.model, ids)):
            torch.testing.assert_close(theirs, ours)


def test_what_does_not_fit_is_refused_in_one_line(world, tmp_path):
    target_dir, cfg_path, target, head = world
    cfg = load_config(cfg_path)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    torch.save({"fc.weight": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(HeadImportError, match="a pickle that runs code when loaded"):
        import_head(pickled, target, tmp_path / "out", cfg)
    with pytest.raises(HeadImportError, match="neither a speculators Eagle3 folder"):
        import_head(target_dir, target, tmp_path / "out", cfg)
    other = load_model(str(save_checkpoint(make_tiny_model(len(make_tokenizer()), seed=0, layers=4, hidden=32),
                                           make_tokenizer(), tmp_path / "other")), device="cpu")
    exported = save_speculators(head, tmp_path / "exported", verifier_name_or_path=str(target_dir))
    with pytest.raises(HeadImportError, match="hidden size mismatch"):
        import_head(exported, other, tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists()


def test_an_imported_head_is_registered_checked_benched_exported_and_warm_starts_a_job(world, tmp_path, capsys):
    from distill.init import init_draft
    from pipeline.config import DistillConfig

    target_dir, cfg_path, target, head = world
    exported = save_speculators(head, tmp_path / "exported", verifier_name_or_path=str(target_dir))
    out = tmp_path / "imported"
    assert main(["models", "import", str(exported), "--config", str(cfg_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"registered: models:/{NAME}/1  alias champion" in printed and "checked: hidden size 64" in printed
    version = mlflow.MlflowClient().get_model_version(NAME, "1")
    assert version.tags[M.VERSION_SOURCE_TAG] == "import" and version.tags[M.IMPORTED_FROM_TAG] == str(exported)
    assert version.tags[M.IMPORT_LAYOUT_TAG] == SPECULATORS and version.tags[M.TARGET_FINGERPRINT_TAG] == \
        target.fingerprint and "not distilled by draftops" in version.description

    # the nightly check: a baseline first, then OK on the same traffic
    for _ in range(2):
        assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["status"] == "OK"
    # bench: every row's output is the target's own
    champion = f"models:/{NAME}@champion"
    assert main(["bench", "--config", str(cfg_path), "--draft", champion, "--split", "all", "--limit", "2",
                 "--llama-cpp", "off", "--json", "--out", str(tmp_path / "bench")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(m["same_output_as_target"] == 2 for m in report["methods"].values())
    assert report["chain"]["k"] == 3
    # export for vLLM: the speculators folder as it is
    assert main(["export", champion, "--format", "vllm", "--out", str(tmp_path / "vllm"), "--config",
                 str(cfg_path)]) == 0
    assert "eagle3" in capsys.readouterr().out and (tmp_path / "vllm" / "config.json").is_file()
    # ... and the starting point of a feature draft job
    warm = init_draft(DistillConfig(family="features", init="checkpoint", init_checkpoint=champion), target.model,
                      token_ids=head.token_ids)
    for name, value in head.state_dict().items():
        torch.testing.assert_close(warm.state_dict()[name], value)
