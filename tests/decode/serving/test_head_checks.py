"""`draftops models import` on a broken or hostile head: each is refused in one line before anything is allocated
for it (`decode.serving.head_checks`), nothing is written or registered, and the process stays small."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.models.feature_draft import feature_draft_from_target
from decode.serving.draft_import import HeadImportError, import_head
from decode.serving.loading import load_model
from decode.serving.speculators import save_speculators
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.decode.serving.test_draft_import import world  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parents[3]
PEAK_RSS_BOUND_MIB = 2048  # the interpreter with torch and transformers, and a tiny target


def _weights(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def _config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _layer(**values):
    return lambda config: config["transformer_layer_config"].update(values)


def _not_dividing(config):
    hidden = config["transformer_layer_config"]["hidden_size"]
    config["transformer_layer_config"].update(num_attention_heads=next(n for n in range(3, hidden) if hidden % n),
                                              num_key_value_heads=None, head_dim=None)


def _narrow_fc(t):
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()


def _d2t_past_vocab(t):
    t["d2t"][-1] += 10_000


HUGE_HEADER = struct.pack("<Q", 1 << 62) + b"{}"
HOSTILE = {
    "d2t past the vocabulary": (lambda f: _weights(f, _d2t_past_vocab), "outside the target's vocabulary"),
    "lm_head of the wrong shape": (lambda f: _weights(f, lambda t: t.update(
        {"lm_head.weight": torch.cat([t["lm_head.weight"], t["lm_head.weight"][:1]])})), "lm_head.weight has shape"),
    "fc of the wrong shape": (lambda f: _weights(f, _narrow_fc), "fc.weight has shape"),
    "no layer config": (lambda f: _config(f, lambda c: c.pop("transformer_layer_config")), "missing or not a mapping"),
    "a layer config that is a list": (lambda f: _config(f, lambda c: c.update(transformer_layer_config=[1])),
                                      "missing or not a mapping"),
    "heads not dividing the hidden size": (lambda f: _config(f, _not_dividing), "do not divide the hidden size"),
    "garbage safetensors": (lambda f: (f / "model.safetensors").write_bytes(b"garbage, not tensors" * 10),
                            "not a safetensors file"),
    "a header claiming 2^62 bytes": (lambda f: (f / "model.safetensors").write_bytes(HUGE_HEADER),
                                     "its header claims 4611686018427387904 bytes"),
    "intermediate size 2^34": (lambda f: _config(f, _layer(intermediate_size=1 << 34)), "intermediate_size is"),
    "a huge hidden size": (lambda f: _config(f, _layer(hidden_size=1 << 20)), "hidden size mismatch"),
    "NaN weights": (lambda f: _weights(f, lambda t: t["fc.weight"].view(-1).__setitem__(0, float("nan"))),
                    "fc.weight holds NaN"),
    "a symlink out of the folder": (lambda f: (f / "tokenizer.json").symlink_to("/etc/passwd"), "outside the folder"),
}


@pytest.fixture(scope="module")
def good_head(tmp_path_factory):
    """(a tiny target, its folder, a reduced-vocabulary head's speculators folder for it): built once."""
    root = tmp_path_factory.mktemp("heads")
    tokenizer = make_tokenizer()
    target_dir = save_checkpoint(make_tiny_model(len(tokenizer), seed=0, layers=4), tokenizer, root / "target")
    target = load_model(str(target_dir), device="cpu", cpu_linear="torch")
    head = feature_draft_from_target(target.model, torch.tensor(sorted({0, 1, 2, *range(5, len(tokenizer), 2)})))
    return target, target_dir, save_speculators(head.eval(), root / "head", verifier_name_or_path=str(target_dir))


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_head_is_refused_in_one_line_and_nothing_written(good_head, tmp_path, case):
    target, target_dir, good = good_head
    folder = Path(shutil.copytree(good, tmp_path / "head"))
    spoil, reason = HOSTILE[case]
    spoil(folder)
    with pytest.raises(HeadImportError) as err:
        import_head(folder, target, tmp_path / "out", load_config(None, [f"target={target_dir}"]))
    assert reason in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "out").exists()


MEASURED = """
import resource, sys
from pipeline.cli import main
code = main(sys.argv[1:])
print("peak_rss_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def test_the_command_exits_2_registers_nothing_and_stays_small(world, tmp_path, mlflow_uri):  # noqa: F811
    """A head whose config asks for a 4 TB MLP: one line, exit 2, no version, a peak RSS under the stated bound."""
    from mlflow import MlflowClient

    target_dir, cfg_path, target, head = world
    folder = save_speculators(head, tmp_path / "head", verifier_name_or_path=str(target_dir))
    _config(folder, _layer(intermediate_size=1 << 34))
    out = subprocess.run([sys.executable, "-c", MEASURED, "models", "import", str(folder), "--config", str(cfg_path),
                          "--out", str(tmp_path / "out")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": mlflow_uri,
                              "PYTHONWARNINGS": "ignore::UserWarning"})  # a busy machine's kernel-timing warning
    assert out.returncode == 2, out.stderr[-2000:]
    # the target's own loading bar (transformers) comes before the check; what the command says is one line
    lines = [line for line in out.stderr.strip().splitlines() if not line.startswith("Loading weights")]
    assert len(lines) == 1 and "intermediate_size is 17179869184" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    peak_mib = int(out.stdout.split("peak_rss_kib")[1]) / 1024
    assert peak_mib < PEAK_RSS_BOUND_MIB, peak_mib
    assert not (tmp_path / "out").exists()
    assert MlflowClient().search_model_versions() == []
