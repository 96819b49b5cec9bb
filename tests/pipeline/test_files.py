import errno
import os
import subprocess
import sys

import pytest

from pipeline import files
from pipeline.files import recover_dir, swap_dir, temporary_sibling, write_text_atomic


def folder(path, text):
    path.mkdir(parents=True, exist_ok=True)
    (path / "weights").write_text(text)
    return path


def test_swap_replaces_the_folder_and_leaves_nothing_beside_it(tmp_path):
    final = folder(tmp_path / "best", "old")
    swap_dir(folder(temporary_sibling(final), "new"), final)
    assert (final / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_swap_stopped_between_its_renames_recovers_the_old_folder(tmp_path, monkeypatch):
    final = folder(tmp_path / "best", "old")
    new = folder(temporary_sibling(final), "new")
    renames = []

    def stop_on_second(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise KeyboardInterrupt("killed")
        os.rename(src, dst)

    monkeypatch.setattr(files.os, "replace", stop_on_second)
    with pytest.raises(KeyboardInterrupt):
        swap_dir(new, final)
    monkeypatch.undo()
    assert not final.exists()  # what a reader would have seen without recovery
    assert (recover_dir(final) / "weights").read_text() == "old"


def test_recover_removes_temporary_folders_of_writers_that_are_gone(tmp_path):
    final = folder(tmp_path / "draft", "kept")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = folder(tmp_path / f"draft.tmp{int(gone.stdout)}", "half")
    mine = folder(temporary_sibling(final), "in progress")
    recover_dir(final)
    assert not dead.exists() and mine.exists() and (final / "weights").read_text() == "kept"


def test_a_text_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_text_atomic(path, "old")

    def full_disk(self, text, *args, **kwargs):
        self.open("w").write(text[:1])  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    monkeypatch.setattr(type(path), "write_text", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_text_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]
