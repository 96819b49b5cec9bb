"""llama.cpp as a peer engine (decode.serving.llamacpp).

Unmarked: the build's CPU options by hand, where the server is looked for, and the errors when it is absent. Marked
`llamacpp` (`make test-llamacpp`, which builds llama-server first): on the real SmolLM2 target's GGUF and a draft
exported with `draftops export --format gguf`, llama.cpp's speculative decoding gives llama.cpp's target-alone greedy
output on shipped prompts, and `draftops monitor check` reads the acceptance of that live llama-server."""
from __future__ import annotations

import json

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from decode.models.layer_draft import draft_from_target_layers
from decode.serving.export import GGUF, draft_source, export_format, target_gguf
from decode.serving.llamacpp import LLAMA_CPP_ENV, LlamaCppError, LlamaServer, build_dir, cmake_cpu_options, find_server
from distill.register import export_draft
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config
from pipeline.sources import DEFAULT_TARGET, resolve_model, save_checkpoint
from pipeline.traffic import DEFAULT_TRAFFIC, encode_prompts, first_per_category, load_traffic
from tests.conftest import make_tiny_model, make_tokenizer


def test_cmake_options_follow_the_cpus_flags_and_never_go_native():
    avx2 = {"avx", "avx2", "fma", "f16c", "amx_tile", "amx_bf16"}
    options = cmake_cpu_options(avx2)
    assert options[0] == "-DGGML_NATIVE=OFF"
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF"} <= set(options)
    assert not any("AMX" in option for option in options)  # advertised AMX is never trusted
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON"} <= set(cmake_cpu_options(avx512))
    assert "-DGGML_AVX512=OFF" in cmake_cpu_options(avx2 | {"avx512f"})  # AVX-512 needs all five subsets
    assert build_dir(avx2) != build_dir(avx512) and build_dir(avx2) == build_dir(set(avx2))


def test_the_server_is_found_where_it_is_said_to_be_and_its_absence_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv(LLAMA_CPP_ENV, str(tmp_path))
    with pytest.raises(LlamaCppError, match="holds no llama-server"):
        find_server()
    (tmp_path / "llama-server").write_text("")
    assert find_server() == tmp_path / "llama-server"
    monkeypatch.delenv(LLAMA_CPP_ENV)
    monkeypatch.setenv("DRAFTOPS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_server() is None
    with pytest.raises(LlamaCppError, match=r"no llama-server: build it with `draftops llama-cpp build`"):
        LlamaServer(tmp_path / "model.gguf")


def test_a_server_that_dies_at_start_says_what_it_printed(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(LlamaCppError, match="exited with 1:\nerror: failed to load model"):
        with LlamaServer(tmp_path / "model.gguf", binary=fake, log=tmp_path / "server.log"):
            pass


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    """The default target's GGUF and, as `make distill` would export it, a draft of its first two layers (untrained:
    greedy identity does not depend on the draft) written as GGUF; shipped held-out prompts, one per category."""
    server = find_server()  # before the tests' own $DRAFTOPS_HOME hides the build
    if server is None:
        pytest.fail("no llama-server: `make test-llamacpp` builds it first (draftops llama-cpp build)")
    root = tmp_path_factory.mktemp("llamacpp")
    target = resolve_model(DEFAULT_TARGET, device="cpu")
    draft = draft_from_target_layers(target.model, [0, 1]).eval()
    cfg = load_config(None, ["decode.gamma=4", "device=cpu"])
    export_draft(draft, target.tokenizer, root / "draft", token_ids=None, cfg=cfg)
    target_file = target_gguf(DEFAULT_TARGET)
    exported = export_format(draft_source(str(root / "draft")), GGUF, root / "gguf", vocabulary=target_file)
    requests = first_per_category(load_traffic(DEFAULT_TRAFFIC).split("heldout"), 1)
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    return {"root": root, "server": server, "target": target_file, "draft": exported / "draft-f16.gguf",
            "prompts": prompts}


@pytest.mark.llamacpp
def test_llama_cpp_speculative_greedy_equals_its_target_alone(llama_cpp):
    binary = llama_cpp["server"]
    with LlamaServer(llama_cpp["target"], binary=binary, log=llama_cpp["root"] / "alone.log") as alone, \
            LlamaServer(llama_cpp["target"], draft=llama_cpp["draft"], draft_max=4, binary=binary,
                        log=llama_cpp["root"] / "spec.log") as spec:
        drafted = accepted = 0
        for prompt in llama_cpp["prompts"]:
            reference = alone.complete(prompt, 48)
            result = spec.complete(prompt, 48)
            assert reference.drafted == 0 and len(reference.tokens) > 0
            assert result.tokens == reference.tokens
            drafted, accepted = drafted + result.drafted, accepted + result.accepted
    assert len(llama_cpp["prompts"]) == 8 and drafted > 0 and 0 < accepted <= drafted
    assert "speculative" in (llama_cpp["root"] / "spec.log").read_text()


@pytest.mark.llamacpp
def test_monitor_check_reads_a_live_llama_server(llama_cpp, tmp_path, mlflow_uri, capsys):
    """The check of a (tiny, offline) champion with `monitor.server_metrics_url` on the llama-server serving the
    exported draft: the first check keeps the counters, the second reads the window of the requests in between,
    which are the acceptance the requests' own timings add up to."""
    from pipeline.cli import main

    tokenizer = make_tokenizer()
    champion = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path / "tiny")
    traffic = tmp_path / "traffic.jsonl"
    with open(traffic, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"write code {i % 7}"}]})
                    + "\n")
    with LlamaServer(llama_cpp["target"], draft=llama_cpp["draft"], draft_max=4, binary=llama_cpp["server"],
                     log=tmp_path / "server.log") as server:
        cfg_path = tmp_path / "cfg.yaml"
        cfg_path.write_text(yaml.safe_dump({
            "target": str(champion), "device": "cpu", "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
            "tracking": {"uri": mlflow_uri, "system_metrics": False}, "decode": {"max_new_tokens": 6, "gamma": 3},
            "monitor": {"heldout_requests": 8, "state_dir": str(tmp_path / "state"), "n_bootstrap": 200,
                        "break_even_alpha": 0.0, "server_metrics_url": server.metrics_url}}))
        mlflow.set_experiment("draftops-distill")
        with mlflow.start_run():
            registry.register(champion, "draftops-draft",
                              tags={M.TARGET_FINGERPRINT_TAG: "any"}, description="test draft")
        assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
        first = json.loads(capsys.readouterr().out)
        assert first["server"]["error"] is None and first["server"]["window"] is None
        completions = [server.complete(prompt, 32) for prompt in llama_cpp["prompts"][:3]]
        assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
        second = json.loads(capsys.readouterr().out)
    drafted, accepted = sum(c.drafted for c in completions), sum(c.accepted for c in completions)
    counters = second["server"]["window"]["counters"]
    assert counters["engine"] == "llamacpp" and drafted > 0
    assert (counters["draft_tokens"], counters["accepted"]) == (drafted, accepted)
    assert second["server"]["acceptance"] == pytest.approx(accepted / drafted)
    metrics = MlflowClient().get_run(second["run_id"]).data.metrics
    assert metrics["acceptance/server"] == pytest.approx(accepted / drafted)
    assert metrics["monitor/server/draft_tokens"] == drafted
