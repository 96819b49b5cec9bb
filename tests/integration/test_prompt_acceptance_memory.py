"""`draftops monitor check` on a traffic log holding one request of 50 MB, with the real target (SmolLM2-135M-Instruct)
and a tiny registered draft that shares its tokenizer: the check's peak memory stays under 2 GB. Tokenized whole, that
request took 9.8 GB (`traffic stats`); the check now cuts it to what traffic.max_prompt_tokens can use first.

`make` runs it with the integration tests (`-m integration`); `python -m
tests.integration.test_prompt_acceptance_memory` prints the figure docs/reliability.md quotes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline import draftops_home
from pipeline.traffic import split_of

REPO = Path(__file__).resolve().parents[2]
BIG_BYTES = 50_000_000
LIMIT_BYTES = 2 << 30
REAL_HOME = draftops_home()  # where the converted target is; each measurement gets a fresh home of its own


def _home_with_the_converted_target(home: Path) -> None:
    """A fresh $DRAFTOPS_HOME (response cache, fingerprints) that reuses the converted target of the real one."""
    (home / "models").mkdir(parents=True)
    for converted in (REAL_HOME / "models").glob("SmolLM2-135M-Instruct*"):
        if converted.is_dir():
            (home / "models" / converted.name).symlink_to(converted)


def _traffic(path: Path, big: bool = True) -> None:
    """40 short requests and, logged last, one of 50 MB (with `big`), all held out at heldout_fraction 0.5."""
    words = "the quick brown fox jumps over the lazy dog and writes python code ".split()
    rows, i = [], 0
    while len(rows) < 40:
        request_id = f"q{i}"
        i += 1
        if split_of(request_id, 0.5) == "heldout":
            rows.append({"id": request_id, "ts": f"2026-10-01T00:{len(rows):02d}:00Z",
                         "messages": [{"role": "user", "content": " ".join(words[(i + k) % len(words)]
                                                                             for k in range(8))}]})
    big_id = next(f"big{j}" for j in range(100) if split_of(f"big{j}", 0.5) == "heldout")
    line = "error at line 42: connection reset by peer; retrying "
    if big:
        content = "Summarize this log. " + line * (BIG_BYTES // len(line) + 1)
        rows.append({"id": big_id, "ts": "2026-10-01T01:00:00Z", "messages": [{"role": "user", "content": content}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _register_tiny_draft(work: Path, uri: str) -> None:
    import mlflow
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline import registry
    from pipeline.sources import locate, save_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(locate("smollm2-135m-instruct").path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    draft = save_checkpoint(LlamaForCausalLM(config).eval(), tokenizer, work / "draft")
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():
        registry.register(draft, "draftops-draft", tags={}, description="tiny draft for the memory figure")


def measure(work: Path, big: bool = True, cpu_linear: str = "auto") -> dict:
    """Run the check in a subprocess (on the log with the 50 MB request, or without it; `cpu_linear` as configured,
    the default "auto"); its exit code, peak RSS (bytes), seconds, and the traffic file's size. The check measures on
    torch's kernels whatever `cpu_linear` says (`monitor.check.prompt_acceptance`)."""
    home = work / "home"
    _home_with_the_converted_target(home)
    os.environ["DRAFTOPS_HOME"] = str(home)
    uri = f"sqlite:///{work}/mlflow.db"
    _register_tiny_draft(work, uri)
    traffic = work / "traffic.jsonl"
    _traffic(traffic, big)
    config = work / "cfg.yaml"
    config.write_text(json.dumps({
        "device": "cpu", "cpu_linear": cpu_linear, "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": uri, "system_metrics": False}, "decode": {"max_new_tokens": 8},
        "monitor": {"heldout_requests": 6, "n_bootstrap": 200, "state_dir": str(work / "state")}}))
    start = time.monotonic()
    with open(work / "out.txt", "w") as out, open(work / "err.txt", "w") as err:
        # a small launcher starts the check: a child forked straight from this (possibly large) process would
        # inherit its resident size as the starting point of its peak
        peak = work / "peak.txt"
        check = [sys.executable, "-m", "pipeline.cli", "monitor", "check", "--config", str(config)]
        child = subprocess.run([sys.executable, "-c", LAUNCHER, str(peak), *check], cwd=work,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=err)
    return {"exit": child.returncode, "stdout": (work / "out.txt").read_text(),
            "stderr": (work / "err.txt").read_text()[-3000:], "seconds": round(time.monotonic() - start, 1),
            "traffic_bytes": traffic.stat().st_size,
            "max_rss_bytes": int(peak.read_text()) * 1024}  # ru_maxrss: KiB


# runs argv[2:] and writes that child's own peak resident size (KiB) to argv[1]
LAUNCHER = ("import os, subprocess, sys\n"
            "child = subprocess.Popen(sys.argv[2:])\n"
            "_, status, usage = os.wait4(child.pid, 0)\n"
            "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")


@pytest.mark.integration
def test_a_check_on_a_log_with_a_50_mb_request_stays_under_2_gb(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTOPS_HOME", os.environ.get("DRAFTOPS_HOME", ""))  # measure() points it elsewhere
    result = measure(tmp_path)
    assert result["exit"] == 0, result["stderr"]
    assert result["traffic_bytes"] > BIG_BYTES and "OK" in result["stdout"]
    assert result["max_rss_bytes"] < LIMIT_BYTES, result


if __name__ == "__main__":
    runs = {}
    for name, big, kernels in (("50 MB request, cpu_linear auto", True, "auto"),
                               ("no big request, cpu_linear auto", False, "auto"),
                               ("50 MB request, cpu_linear torch", True, "torch"))[int((sys.argv[1:] or ["0"])[0]):]:
        with tempfile.TemporaryDirectory() as folder:
            figure = measure(Path(folder), big, kernels)
        runs[name] = {k: v for k, v in figure.items() if k not in ("stdout", "stderr")}
        print(name, json.dumps(runs[name]), figure["stdout"].splitlines()[:1] or figure["stderr"][-1500:],
              flush=True)
