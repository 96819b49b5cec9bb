"""Shared fixtures: tiny models built from config and a small word-level tokenizer with a chat template."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("system user assistant the a of to and is in what how why write code explain translate sum "
         "number one two three four five six seven eight nine ten hello world please story poem python "
         "function list sort math answer question french german text short long").split()


def make_tokenizer(extra_words: int = 0):
    """A word-level tokenizer: ids 0-2 special, then WORDS, then `w0..wN` filler words, `[UNK]` last."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS + [f"w{i}" for i in range(extra_words)])}
    vocab["[UNK]"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="[UNK]")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64):
    """A Llama-architecture causal LM from config: 2 layers, hidden 64 (the project's test size)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_tokenizer):
    """A saved tiny HF checkpoint directory (model + tokenizer) built from config."""
    from pipeline.sources import save_checkpoint

    model = make_tiny_model(len(tiny_tokenizer))
    return save_checkpoint(model, tiny_tokenizer, tmp_path / "tiny")


@pytest.fixture(autouse=True)
def one_thread(request):
    """Tiny models are dominated by per-op overhead: one intra-op thread is faster and does not spin against other
    jobs on a 2-core machine. Integration tests on the real target keep the default."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def isolated_home(request, tmp_path, monkeypatch):
    """Caches and MLflow stores of a test stay in its tmp dir; integration tests share the real model cache."""
    if request.node.get_closest_marker("integration") is None:
        monkeypatch.setenv("DRAFTOPS_HOME", str(tmp_path / "draftops_home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    return tmp_path


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data(name: str) -> Path:
    """A public prompt set from ../shared/data, used by path (never copied into the repo); skips where absent."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} is not available on this machine")
    return path


@pytest.fixture(scope="session")
def _migrated_mlflow_db(tmp_path_factory):
    """Creating MLflow's sqlite schema takes seconds; do it once and copy the file per test."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, _migrated_mlflow_db, monkeypatch):
    """A fresh sqlite MLflow store for this test (tracking and registry)."""
    import mlflow

    path = tmp_path / "mlflow.db"
    shutil.copy(_migrated_mlflow_db, path)
    uri = f"sqlite:///{path}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def reset_accelerate_state() -> None:
    """accelerate keeps one AcceleratorState a process and refuses an Accelerator with other settings (mixed
    precision, CPU or not) after it: a distill job after this starts from none, as a `draftops distill` process does."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test's distill job starts from no accelerate state (`reset_accelerate_state`)."""
    yield
    reset_accelerate_state()
