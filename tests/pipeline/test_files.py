import os
import subprocess
import sys

import pytest

from pipeline import files
from pipeline.files import recover_dir, swap_dir, temporary_sibling


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
