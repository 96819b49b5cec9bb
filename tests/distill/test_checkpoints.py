"""Resuming loads accelerate's scheduler and RNG states with `weights_only=False` (pickles that can run code): only
from the job's own folder, never through a link to files elsewhere."""
import json

import pytest

from distill.checkpoints import STATE_FILE, UnsafeCheckpoint, load_training_state


class RecordingAccelerator:
    def __init__(self):
        self.loaded = []

    def load_state(self, path):
        self.loaded.append(path)


def checkpoint_in(folder):
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": 5}))
    (folder / "custom_checkpoint_0.pkl").write_bytes(b"pickle")
    return folder


def test_a_checkpoint_of_the_job_itself_is_loaded(tmp_path):
    job = tmp_path / "job"
    checkpoint = checkpoint_in(job / "checkpoints" / "step-0000005")
    accelerator = RecordingAccelerator()
    assert load_training_state(accelerator, checkpoint, job) == {"step": 5}
    assert accelerator.loaded == [str(checkpoint)]


def test_a_checkpoint_linked_from_elsewhere_is_refused_before_anything_is_unpickled(tmp_path):
    job = tmp_path / "job"
    (job / "checkpoints").mkdir(parents=True)
    elsewhere = checkpoint_in(tmp_path / "downloaded" / "step-0000009")
    linked = job / "checkpoints" / "step-0000009"
    linked.symlink_to(elsewhere, target_is_directory=True)
    accelerator = RecordingAccelerator()
    with pytest.raises(UnsafeCheckpoint, match="only from the job's own folder"):
        load_training_state(accelerator, linked, job)
    own = checkpoint_in(job / "checkpoints" / "step-0000010")
    (own / "custom_checkpoint_0.pkl").unlink()
    (own / "custom_checkpoint_0.pkl").symlink_to(elsewhere / "custom_checkpoint_0.pkl")
    with pytest.raises(UnsafeCheckpoint):
        load_training_state(accelerator, own, job)
    assert accelerator.loaded == []
