"""The feature cache (distill.features): batched right-padded passes give each sequence's own features; a second
job reads them back; a file that does not fit the responses is computed again."""
import torch

from decode.feature_draft import target_features
from distill.features import cached_features, features_file, teacher_forced_features
from distill.responses import ResponseSet
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
