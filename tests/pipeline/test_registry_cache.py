"""A registered version's local copy is checked against the registry's listing when it arrives and against its
manifest every time it is used: a truncated or damaged copy is downloaded again, and a download that cannot be
completed says why (a full disk) in one line."""
import errno
import json
import shutil

import mlflow
import pytest

from pipeline import registry, registry_cache
from pipeline.registry_cache import MANIFEST
from pipeline.sources import SourceError, locate

NAME = "drafts"


@pytest.fixture
def registered(mlflow_uri, tiny_checkpoint):
    """Version 1 of NAME holds the tiny checkpoint; returns its source and the original weights' size."""
    mlflow.set_experiment("registry-cache")
    with mlflow.start_run():
        registry.register(tiny_checkpoint, NAME, tags={}, description="d")
    return f"models:/{NAME}/1", (tiny_checkpoint / "model.safetensors").stat().st_size


def test_a_truncated_local_copy_is_downloaded_again(registered):
    source, size = registered
    first = locate(source)
    weights = first.path / "model.safetensors"
    assert weights.stat().st_size == size and (first.path / MANIFEST).exists()
    fingerprint = first.fingerprint
    with open(weights, "r+b") as f:  # what a full disk or a killed copy leaves
        f.truncate(size // 2)
    again = locate(source)
    assert again.path == first.path and weights.stat().st_size == size and again.fingerprint == fingerprint


def test_a_changed_file_of_the_same_size_is_downloaded_again(registered):
    source, size = registered
    weights = locate(source).path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # a new modification time: the sha256 is checked
    assert registry_cache.damage(weights.parent) == "model.safetensors changed since it was downloaded (sha256)"
    locate(source)
    assert registry_cache.damage(weights.parent) is None and weights.read_bytes()[-1] == data[-1] ^ 0xFF


def test_a_copy_without_a_manifest_is_downloaded_again_once(registered):
    source, _ = registered
    folder = locate(source).path
    (folder / MANIFEST).unlink()  # as an older draftops left it
    assert "no record of a complete download" in registry_cache.damage(folder)
    locate(source)
    assert registry_cache.damage(folder) is None


def test_a_download_shorter_than_the_listing_is_repeated_then_refused(registered, monkeypatch):
    source, size = registered
    real = registry_cache.download
    cuts = []

    def truncating(version, dst):
        root = real(version, dst)
        if len(cuts) < limit:
            cuts.append(1)
            with open(root / "model.safetensors", "r+b") as f:
                f.truncate(100)
        return root

    monkeypatch.setattr(registry_cache, "download", truncating)
    limit = 1  # the first download comes back short, the second whole
    assert (locate(source).path / "model.safetensors").stat().st_size == size and len(cuts) == 1
    shutil.rmtree(locate(source).path)
    cuts.clear()
    limit = 10  # always short
    with pytest.raises(SourceError, match=f"download stays incomplete: model.safetensors has 100 bytes, the "
                                          f"registry lists {size}"):
        locate(source)


def test_a_full_disk_during_the_download_names_the_cause(registered, monkeypatch):
    source, _ = registered

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copy2", no_space)
    monkeypatch.setattr(shutil, "copyfile", no_space)
    with pytest.raises(SourceError) as err:
        locate(source)
    assert "No space left on device" in str(err.value) and str(err.value).startswith(source)
    assert "\n" not in str(err.value)


def test_a_damaged_manifest_is_damage_not_a_traceback(registered):
    source, _ = registered
    folder = locate(source).path
    for text in ("{", "[]", json.dumps({"files": {"model.safetensors": {"size": "x"}}})):
        (folder / MANIFEST).write_text(text)
        assert registry_cache.damage(folder)
        locate(source)
        assert registry_cache.damage(folder) is None
