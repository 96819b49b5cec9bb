"""decode.runtime.forward: the transformers forward's KV cache keyword, whichever transformers names it."""
import torch
from transformers import DynamicCache

from decode.runtime.forward import forward_logits, with_cache
from tests.conftest import make_tiny_model


def test_the_cache_goes_under_the_name_the_forward_takes():
    """transformers renamed `past_key_values` to `cache` (5.17 has the old name, 5.25 the new); an unknown keyword
    is swallowed by **kwargs and the forward then runs without the cache, so the name comes from the signature."""

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, past_key_values=None, **kwargs): ...

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class Wrapper(torch.nn.Module):
        def forward(self, *args, **kwargs): ...

    cache = object()
    assert with_cache(Renamed(), cache) == {"cache": cache}
    assert with_cache(Older(), cache) == {"past_key_values": cache}
    assert with_cache(Wrapper(), cache) == {"cache": cache}


@torch.no_grad()
def test_a_continuation_through_the_cache_gives_the_full_passs_logits():
    model = make_tiny_model(40, seed=3)
    tokens = torch.tensor([1, 5, 9, 3, 7, 7, 2])
    cache = DynamicCache(config=model.config)
    first = forward_logits(model, tokens[:4], cache, 0, keep_last=False)
    rest = forward_logits(model, tokens[4:], cache, 4, keep_last=False)
    torch.testing.assert_close(torch.cat([first, rest]), model(tokens[None]).logits[0], rtol=1e-5, atol=1e-5)
