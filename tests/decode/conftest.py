import pytest
import torch

from tests.decode.tiny import perturbed_copy, tiny_llama


@pytest.fixture(scope="session")
def target() -> torch.nn.Module:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def random_draft() -> torch.nn.Module:
    return tiny_llama(1)


@pytest.fixture(scope="session")
def close_draft(target) -> torch.nn.Module:
    return perturbed_copy(target, seed=2, noise=0.03)


@pytest.fixture(scope="session")
def reduced_draft() -> tuple[torch.nn.Module, torch.Tensor]:
    token_ids = torch.arange(0, 128, 2)
    return tiny_llama(3, draft_vocab=len(token_ids)), token_ids
