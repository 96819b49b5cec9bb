import torch

from distill.data.batches import collate, global_batch_indices, micro_batch
from distill.data.responses import generate_responses
from tests.conftest import make_tiny_model, make_tokenizer

PROMPTS = [[1, 10, 11, 12], [1, 20, 21]]


def test_data_order_is_a_pure_function_of_seed_and_step():
    steps = [global_batch_indices(10, s, 4, seed=3) for s in range(4)]
    assert steps == [global_batch_indices(10, s, 4, seed=3) for s in range(4)]
    assert len(set(steps[0] + steps[1])) == 8  # one epoch: no example twice, the 2 leftovers dropped
    assert steps[2] != steps[0] and len(set(steps[2] + steps[3])) == 8  # epoch 2: a new permutation
    assert global_batch_indices(10, 0, 4, seed=4) != steps[0]
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 0]
    grouped = [global_batch_indices(10, s, 4, seed=3, lengths=lengths, group=2) for s in range(2)]
    assert sorted(grouped[0] + grouped[1]) == sorted(steps[0] + steps[1])  # same epoch, regrouped by length
    assert [lengths[i] for i in grouped[0] + grouped[1]] == sorted(
        (lengths[i] for i in steps[0] + steps[1]), reverse=True)
    batch = list(range(8))
    # 2 processes × 2 micro-batches and 1 process × 4 micro-batches cover the same examples
    two = [micro_batch(batch, m, r, 2, 2) for m in range(2) for r in range(2)]
    one = [micro_batch(batch, m, 0, 1, 2) for m in range(4)]
    assert two == one == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_collate_aligns_mask_labels_and_teacher_with_response_tokens():
    tokenizer = make_tokenizer()
    model = make_tiny_model(len(tokenizer), seed=0)
    out = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=4, temperature=0.0, batch_size=2, seed=0,
                             topk=3)
    token_ids = torch.tensor(sorted(set(out.response_ids[0])))
    batch = collate(out, [0, 1], pad_id=0, token_ids=token_ids, with_teacher=True, topk=2)
    for row in range(2):
        prompt, response = out.prompt_ids[row], out.response_ids[row]
        positions = batch["loss_mask"][row].nonzero().flatten().tolist()
        assert positions == list(range(len(prompt) - 1, len(prompt) + len(response) - 1))
        assert batch["input_ids"][row, positions[0] + 1:positions[-1] + 2].tolist() == response
        values, ids = out.teacher_rows(row)
        assert torch.equal(batch["teacher"].logprobs[row, positions], values[:, :2])
        columns = batch["teacher"].indices[row, positions]
        expected = [[token_ids.tolist().index(t) if t in token_ids else -1 for t in r] for r in ids[:, :2].tolist()]
        assert columns.tolist() == expected
        labels = batch["labels"][row, positions].tolist()
        assert labels == [token_ids.tolist().index(t) if t in token_ids else -100 for t in response]
    assert batch["labels"][0, 0] == -100 and not batch["loss_mask"][1, -1]
