"""Tiny float64 Llama models for decoder tests."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def tiny_llama(
    seed: int,
    vocab_size: int = 128,
    *,
    draft_vocab: int | None = None,
    init_range: float = 0.3,
    context: int = 512,
) -> torch.nn.Module:
    """A tiny random Llama in float64 (no rounding ties between cached and uncached passes).

    A large init range makes next-token distributions peaked, so drafts actually get rejected. No EOS id: the decoder
    stops at its target's EOS by default, and these tests compare fixed-length outputs (a test that needs one sets it).
    draft_vocab gives a reduced-vocab lm_head over that many rows, keeping full-vocab input embeddings.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config)
    if draft_vocab is not None:
        model.lm_head = torch.nn.Linear(64, draft_vocab, bias=False)
        torch.nn.init.normal_(model.lm_head.weight, std=init_range)
    return model.to(torch.float64).eval()


def perturbed_copy(model: torch.nn.Module, seed: int, noise: float) -> torch.nn.Module:
    """A draft close to `model`: the same weights plus relative Gaussian noise."""
    copy = tiny_llama(seed, model.config.vocab_size, context=model.config.max_position_embeddings)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return copy


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain target-only greedy decoding without any cache."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def word_tokenizer(vocab_size: int):
    """A word-level HF tokenizer whose token i is the word `w{i}` (decode joins words with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0")
