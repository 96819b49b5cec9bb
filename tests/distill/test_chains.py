"""distill.chains: the on-policy stage's layout scores each chain as the plain forward of its own text would, and
its chains are the draft's own proposals."""
import torch

from decode.models.architectures import head_logits
from decode.runtime.forward import target_features
from distill.chains import chain_batch, chain_loss, layout, node_hidden, propose, valid_logits
from distill.step import FeatureStepLogits
from pipeline.config import DistillConfig
from tests.conftest import make_tiny_model
from tests.decode.models.test_feature_draft import make_feature_draft

K = 3


def a_batch():
    """Two right-padded rows: prompt [1, 5] + response [7, 8, 9]; prompt [1, 4, 6] + response [3], one pad."""
    input_ids = torch.tensor([[1, 5, 7, 8, 9], [1, 4, 6, 3, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    loss_mask = torch.tensor([[False, True, True, True, False], [False, False, True, False, False]])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def chain_text(chains, b: int, s: int, t: int) -> list[int]:
    """Row b's text up to start s and that start's chain tokens."""
    start = int(chains.starts[b, s])
    width = chains.nodes.shape[2]
    return chains.input_ids[b, : start + 1].tolist() + [int(chains.input_ids[b, t + (j - 1) * width + s])
                                                         for j in range(1, K)]


@torch.no_grad()
def test_greedy_chains_are_the_drafts_own_and_every_node_sees_what_a_plain_forward_would():
    draft = make_tiny_model(40, seed=1).eval()
    batch = a_batch()
    chains = layout(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], K, torch.float32)
    assert chains.starts.tolist() == [[1, 2, 3], [2, 2, 2]] and chains.valid[1].tolist() == [[True, False, False],
                                                                                             [False] * 3, [False] * 3]
    assert chains.valid[0].tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    propose(draft, chains, None, 1.0, torch.Generator().manual_seed(0))
    hidden = node_hidden(draft, chains)
    t = batch["input_ids"].shape[1]
    for s in range(3):  # row 0 is greedy: each chain token is the argmax after the text before it
        text = chain_text(chains, 0, s, t)
        start = int(chains.starts[0, s])
        plain = draft.model(input_ids=torch.tensor([text])).last_hidden_state[0]
        for j in range(K):
            torch.testing.assert_close(hidden[0, j, s], plain[start + j], atol=1e-5, rtol=1e-5)
            if j + 1 < K:
                assert text[start + 1 + j] == int(head_logits(draft, plain[start + j]).argmax())


@torch.no_grad()
def test_sampled_chains_repeat_for_a_seed_and_use_only_the_draft_vocabulary():
    draft = make_tiny_model(40, seed=2).eval()
    token_ids = torch.tensor([3, 5, 7, 11, 13, 17])
    draft.lm_head = torch.nn.Linear(64, len(token_ids), bias=False)
    batch = {**a_batch(), "labels": None}
    made = [chain_batch(batch, draft, DistillConfig(onpolicy_k=K), token_ids, seed=7)["chains"] for _ in range(2)]
    assert torch.equal(made[0].input_ids, made[1].input_ids)
    t = batch["input_ids"].shape[1]
    appended = made[0].input_ids[:, t:]
    assert set(appended.flatten().tolist()) <= set(token_ids.tolist())
    other = chain_batch(batch, draft, DistillConfig(onpolicy_k=K), token_ids, seed=8)["chains"]
    assert torch.equal(other.input_ids[0], made[0].input_ids[0])  # row 0 greedy: no draw
    assert draft.training is False


def test_chain_loss_weights_each_node_by_its_chains_reach():
    draft, target = make_tiny_model(40, seed=3), make_tiny_model(40, seed=4)
    batch = a_batch()
    chains = chain_batch(batch, draft, DistillConfig(onpolicy_k=K), None, seed=0)["chains"]
    logits = valid_logits(draft, chains)
    with torch.no_grad():
        teacher = valid_logits(target, chains)
    d = DistillConfig(loss="log_acceptance")
    loss = chain_loss(logits, teacher, chains, d, token_ids=None, num_tokens=4)
    loss.backward()
    assert torch.isfinite(loss) and draft.lm_head.weight.grad.abs().sum() > 0
    # by hand: the acceptance at each valid node, the chain's product before it, −log(α + ε) weighted
    alpha = torch.minimum(logits.softmax(-1), teacher.softmax(-1)).sum(-1).detach()
    grid = torch.zeros(chains.valid.shape)
    grid[chains.valid] = alpha
    reach = torch.ones_like(grid)
    reach[:, 1] = grid[:, 0]
    reach[:, 2] = grid[:, 0] * grid[:, 1]
    expected = (-(alpha + 1e-3).log() * reach[chains.valid]).sum() / 4
    assert abs(loss.item() - expected.item()) < 1e-5


def test_a_feature_drafts_chains_are_what_decoding_proposes_and_training_scores_what_decoding_computes():
    """A feature draft's chains: on the greedy row, each start's chain is what decoding proposes past that verified
    prefix (its steps fed its own tokens); the training forward's logits at every node are decoding's there; the
    sampled row repeats for a seed; the reach-weighted loss trains the draft."""
    target = make_tiny_model(40, seed=3, layers=4)
    draft = make_feature_draft(target)
    batch = a_batch()
    with torch.no_grad():
        hidden_states = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               output_hidden_states=True).hidden_states
    features = target_features(hidden_states, draft.feature_layers)
    batch = {**batch, "features": features}
    made = chain_batch(batch, draft, DistillConfig(onpolicy_k=K), None, seed=7)
    chains, fed = made["chains"], made["fed"]
    again = chain_batch(batch, draft, DistillConfig(onpolicy_k=K), None, seed=7)
    assert torch.equal(again["chains"].input_ids, chains.input_ids) and torch.equal(again["fed"], fed)
    logits = FeatureStepLogits(draft, K)(features, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                         chains=chains, fed=fed)
    row = torch.full(chains.valid.shape, -1)
    row[chains.valid] = torch.arange(len(logits))
    t, seq = batch["input_ids"].shape[1], batch["input_ids"][0]
    with torch.no_grad():
        for s in range(3):
            p = int(chains.starts[0, s])
            text = chain_text(chains, 0, s, t)
            cache = draft.new_cache()  # decoding past the verified prefix seq[: p + 1], as `FeatureDrafter` does
            out = draft.step(draft.fuse(features[0, :p]), seq[1 : p + 1], cache, 0, torch.arange(1, p + 1))[-1:]
            for j in range(K):
                if chains.valid[0, j, s]:
                    torch.testing.assert_close(logits[row[0, j, s]], draft.logits(out)[0], atol=1e-5, rtol=1e-5)
                if j + 1 < K:
                    proposed = int(draft.logits(out)[0].argmax())
                    assert text[p + 1 + j] == proposed
                    out = draft.step(out, torch.tensor([proposed]), cache, p + j, torch.tensor([p + 1 + j]))
    teacher = valid_logits(target, chains).detach()
    loss = chain_loss(logits, teacher, chains, DistillConfig(loss="kl_tv"), token_ids=None, num_tokens=4)
    loss.backward()
    assert torch.isfinite(loss) and draft.fc.weight.grad.abs().sum() > 0
