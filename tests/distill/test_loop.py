"""FSDP2 on a CPU: the distill loop's gradient clipping and evaluation on 2 gloo ranks of a sharded draft against
one process, and why `configs/accelerate/fsdp.yaml` cannot run the whole job on a CPU."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distill.heldout_eval import cached_eval
from distill.loop import trainable_parameters
from distill.step import ResponseLogits, loss_step
from tests.distill.fsdp_step import SETTINGS, heldout_and_batches, tiny_draft

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_step() -> dict:
    heldout, batches, num_tokens = heldout_and_batches(rank=0, world=1)
    model = ResponseLogits(tiny_draft())
    optimizer = torch.optim.SGD(trainable_parameters(model), lr=SETTINGS.learning_rate)
    loss = loss_step(model, batches[0], SETTINGS, num_tokens=num_tokens, token_ids=None, device="cpu")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), SETTINGS.max_grad_norm)
    optimizer.step()
    model.eval()
    return {"loss": loss.item(), "grad_norm": grad_norm.item(), "eval": cached_eval(model, heldout, None, gamma=3)}


def test_two_fsdp2_ranks_clip_and_evaluate_like_one_process(tmp_path):
    """Sharded parameters (DTensors) get the gradients; the loop clips those (a list taken before sharding gets no
    gradient at all, the bug this guards) and evaluates through the sharded module, which gathers the shards."""
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO / "tests/distill/fsdp_ranks.py"), str(tmp_path)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300)
    assert launched.returncode == 0, launched.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = one_process_step()
    assert one["grad_norm"] > SETTINGS.max_grad_norm  # clipping changes the step
    for rank in ranks:
        assert rank["world"] == 2 and rank["sharded"] == "DTensor"
        assert rank["grads_on_parameters_before_prepare"] == 0
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert rank["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        for key in ("alpha_t0", "alpha_t1", "tau_t0", "tau_t1"):
            assert rank["eval"][key] == pytest.approx(one["eval"][key], abs=1e-5), key
    assert one["eval"]["alpha_t1"] != cached_eval(ResponseLogits(tiny_draft()).eval(),
                                                  heldout_and_batches(0, 1)[0], None, gamma=3)["alpha_t1"]


def test_accelerate_runs_fsdp_only_on_accelerators(tmp_path):
    """Why the FSDP config runs end to end only on a GPU (tests/integration/test_cuda.py): accelerate (1.15) turns FSDP
    on only for GPU-like distributed types; on a CPU the same launch gives plain gloo data parallelism with no FSDP
    plugin. When this fails, accelerate runs FSDP on CPUs: run `draftops distill --accelerate-config
    configs/accelerate/fsdp.yaml` in a test against one process, as for configs/accelerate/cpu_2proc.yaml."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nfrom pathlib import Path\nfrom accelerate import Accelerator\n"
                     "a = Accelerator(cpu=True)\n"  # each rank writes its own file: their stdout interleaves
                     "Path(sys.argv[1], f'rank{a.process_index}').write_text("
                     "f'{a.distributed_type} {getattr(a.state, \"fsdp_plugin\", None)}')\n")
    launched = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch",
         "--config_file", str(REPO / "configs/accelerate/fsdp.yaml"),
         "--main_process_port", str(free_port()), str(probe), str(tmp_path)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-8000:]
    seen = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert seen == ["DistributedType.MULTI_CPU None"] * 2
