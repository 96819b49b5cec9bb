"""The feature cache (distill.data.features): batched right-padded passes give each sequence's own features; a second
job reads them back; a file that does not fit the responses is computed again."""
import torch

from decode.runtime.forward import target_features
from distill.data.features import cached_features, cached_final, features_file, teacher_forced_features
from distill.data.responses import ResponseSet
from tests.conftest import make_tiny_model

LAYERS = (1, 2, 3)


def test_batched_features_are_each_sequences_own_in_the_given_order():
    model = make_tiny_model(40, seed=2, layers=4)
    sequences = [[1, 5, 9, 3, 7], [1, 8], [1, 4, 4, 6]]
    features, offsets = teacher_forced_features(model, sequences, LAYERS, batch_size=2)
    assert features.dtype == torch.float16 and offsets.tolist() == [0, 5, 7, 11]
    for i, seq in enumerate(sequences):
        alone = target_features(model.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states,
                                LAYERS)[0]
        torch.testing.assert_close(features[offsets[i] : offsets[i + 1]].float(), alone, atol=2e-3, rtol=2e-3)


def test_a_second_job_reads_the_cache_and_a_file_for_other_responses_is_replaced(tmp_path):
    model = make_tiny_model(40, seed=2, layers=4)
    responses = ResponseSet(["a", "b"], [[1, 5], [1, 8, 9]], [[7, 2], [3]])
    first, offsets, hit = cached_features(model, responses, tmp_path, LAYERS)
    assert not hit and features_file(tmp_path, LAYERS, 2).exists() and offsets.tolist() == [0, 4, 8]
    again, _, hit = cached_features(model, responses, tmp_path, LAYERS)
    assert hit and torch.equal(again, first)
    other = ResponseSet(["a", "b"], [[1, 5], [1, 8, 9]], [[7], [3]])  # same count, other lengths
    _, offsets, hit = cached_features(model, other, tmp_path, LAYERS)
    assert not hit and offsets.tolist() == [0, 3, 7]


def test_features_recorded_as_the_target_generates_are_kept_without_a_teacher_forced_pass(monkeypatch, tmp_path):
    from distill.data.responses import cached_responses
    from pipeline.traffic import Request
    from tests.conftest import make_tokenizer

    model = make_tiny_model(len(make_tokenizer()), seed=2, layers=4)
    prompts = [[1, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33]]
    requests = [Request(f"q{i}", "c", ({"role": "user", "content": "x"},)) for i in range(len(prompts))]
    kw = dict(samples=2, max_new_tokens=5, temperature=1.0, batch_size=2, seed=3, topk=4)
    responses, cache_dir, _ = cached_responses(model, make_tokenizer(), "fp", requests, prompts, capture=LAYERS, **kw)
    sequences = [p + r for p, r in zip(responses.prompt_ids, responses.response_ids)]
    forced, forced_offsets = teacher_forced_features(model, sequences, LAYERS)
    assert torch.equal(responses.feature_offsets, forced_offsets)
    torch.testing.assert_close(responses.features.float(), forced.float(), atol=3e-3, rtol=3e-3)
    monkeypatch.setattr("distill.data.features.teacher_forced_features", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("recorded features were computed again")))
    features, offsets, hit = cached_features(model, responses, cache_dir, LAYERS)
    assert not hit and torch.equal(features, responses.features) and features_file(cache_dir, LAYERS, 6).exists()
    # the next job reads its responses from the cache, without features, and the features from their file
    again, _, all_cached = cached_responses(model, make_tokenizer(), "fp", requests, prompts, capture=LAYERS, **kw)
    assert all_cached and again.features is None
    assert torch.equal(cached_features(model, again, cache_dir, LAYERS)[0], features)


def test_cached_final_states_rebuild_the_targets_whole_distribution_over_any_head_rows(tmp_path):
    """teacher=final: the cached final states and log-normalizers, through the batch, give the target's own
    log-probabilities at every position over a reduced vocabulary, and its mass on the other ids in the tail."""
    from distill.data.batches import collate
    from distill.losses import bucket_log_probs
    from distill.step import final_teacher

    model = make_tiny_model(40, seed=2, layers=4)
    responses = ResponseSet(["a", "b"], [[1, 5, 9], [1, 8]], [[7, 2], [3, 4, 6]])
    hidden, log_z, hit = cached_final(model, responses, tmp_path)
    assert not hit and hidden.dtype == torch.float16 and log_z.shape == (10,)
    again, _, hit = cached_final(model, responses, tmp_path)
    assert hit and torch.equal(again, hidden)
    responses.final_hidden, responses.final_log_z = hidden, log_z
    responses.feature_offsets = torch.tensor([0, 5, 10])
    token_ids = torch.tensor([0, 2, 3, 7, 9, 11])
    batch = collate(responses, [0, 1], pad_id=0, token_ids=token_ids, with_teacher=False, topk=4, with_final=True)
    teacher = final_teacher(batch, model, token_ids, "cpu")
    mask = batch["loss_mask"]  # the response positions, the only ones a step reads
    for row, seq in enumerate([[1, 5, 9, 7, 2], [1, 8, 3, 4, 6]]):
        full = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        torch.testing.assert_close(teacher.logprobs[row][mask[row]], full[mask[row]][:, token_ids], atol=5e-3,
                                   rtol=5e-3)
    log_p, _ = bucket_log_probs(torch.zeros(int(mask.sum()), len(token_ids)), teacher[mask])
    outside = torch.ones(40, dtype=torch.bool)
    outside[token_ids] = False
    full = torch.log_softmax(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float(), -1)
    torch.testing.assert_close(log_p[:, -1].exp(), full[mask][:, outside].exp().sum(-1), atol=5e-3, rtol=5e-3)
