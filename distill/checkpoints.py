"""A job's folders on disk: `<output_dir>/<job key>/` holds `checkpoints/step-N` (resumable training state),
`best/` (the best weights by τ so far) and the export; `<output_dir>/latest` points at the last export.

Every write goes to a temporary folder renamed into place, so a kill -9 at any moment leaves either the previous
complete checkpoint or the new one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors

from distill.init import init_draft
from distill.step import draft_module
from pipeline.config import DraftopsConfig
from pipeline.files import TMP_SUFFIX, recover_dir, swap_dir

STATE_FILE = "trainer_state.json"


SELECTION_KEYS = ("gamma", "temperature")  # the decode settings training reads: the best checkpoint is the best τ there


# settings that reach the job key only when set away from their defaults, so that jobs made before they existed (all
# of them at these defaults) are found again; what they change reaches the data fingerprint too
UNSET_WHEN_DEFAULT = {("traffic", "columns"): {}, ("traffic", "reasoning"): "template",
                      ("traffic", "chat_template"): None, ("traffic", "served_by"): None, ("traffic", "turns"): "last",
                      ("distill", "responses", "source"): "generate"}


def job_key(cfg: DraftopsConfig, data_fingerprint: str) -> str:
    """Identifies a job for resuming: everything that changes the weights or which checkpoint is kept, nothing that
    only changes bookkeeping or later decoding (so a decode key added to the schema leaves finished jobs found)."""
    settings = cfg.to_dict()
    for section in ("tracking", "monitor", "target_update"):
        settings.pop(section, None)
    settings["decode"] = {key: settings["decode"][key] for key in SELECTION_KEYS}
    for key in ("resume", "register_model", "checkpoint_every", "keep_checkpoints", "output_dir"):
        settings["distill"].pop(key, None)
    for (section, *path), default in UNSET_WHEN_DEFAULT.items():  # keys of the data's shape: only when set
        parent = settings[section]
        for key in path[:-1]:
            parent = parent[key]
        if parent.get(path[-1]) == default:
            parent.pop(path[-1])
    return hashlib.sha256(json.dumps([settings, data_fingerprint], sort_keys=True).encode()).hexdigest()[:12]


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint (a `.tmp` folder is a save that was cut short), or None."""
    done = sorted(p for p in checkpoints.glob("step-*") if (p / STATE_FILE).exists() and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def checkpoint_precision(job_dir: Path) -> str | None:
    """The precision ("no", "bf16", "fp16") the job's last checkpoint trained in; None without a checkpoint or from
    one that did not record it. Read as JSON: nothing of the checkpoint is unpickled."""
    last = latest_checkpoint(job_dir / "checkpoints")
    return None if last is None else json.loads((last / STATE_FILE).read_text()).get("mixed_precision")


def save_training_state(accelerator, checkpoints: Path, step: int, state: dict, keep: int) -> None:
    """accelerate.save_state + our step/best/history, written to a temporary folder and renamed into place."""
    final = checkpoints / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in checkpoints.glob("step-*") if not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


class UnsafeCheckpoint(ValueError):
    """A checkpoint to resume from that is not entirely the job's own files."""


def check_own_checkpoint(checkpoint: Path, job_dir: Path) -> None:
    """Refuse a checkpoint that is, or holds, a link or a file outside the job's folder: accelerate loads the
    scheduler's and RNG states with `weights_only=False`, a pickle that can run code, so only files this job wrote
    are ever loaded."""
    root = job_dir.resolve()
    for path in [checkpoint, *checkpoint.rglob("*")]:
        if path.is_symlink() or not path.resolve().is_relative_to(root):
            raise UnsafeCheckpoint(f"{path}: not resuming from it: a resumable checkpoint is loaded only from the "
                                   f"job's own folder {root} (no links), as its states are pickles")


def load_training_state(accelerator, checkpoint: Path, job_dir: Path) -> dict:
    """Restores what `save_training_state` wrote (model, optimizer, registered scheduler, RNG states) and returns
    our step/best/history; only from the job's own folder (`check_own_checkpoint`)."""
    check_own_checkpoint(checkpoint, job_dir)
    accelerator.load_state(str(checkpoint))
    return json.loads((checkpoint / STATE_FILE).read_text())


def save_best(accelerator, model, best_dir: Path) -> None:
    """The draft's full weights (gathered by accelerate under FSDP; tied tensors stored once), renamed into place."""
    tmp = best_dir.with_name(best_dir.name + TMP_SUFFIX)  # one name every rank agrees on
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_model(model, str(tmp), safe_serialization=True)  # a collective: every rank calls it
    # every rank lists the folder inside save_model: the main one renames it away only after all are done
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        swap_dir(tmp, best_dir)
    accelerator.wait_for_everyone()


def load_best(cfg: DraftopsConfig, target_model, token_ids: torch.Tensor | None, best_dir: Path):
    """A fresh, plain (unsharded) draft holding the best weights: what export sees whatever the distribution was."""
    draft = init_draft(cfg.distill, target_model, token_ids=token_ids)
    load_safetensors(draft_module(cfg.distill, draft), str(recover_dir(best_dir) / "model.safetensors"))
    return draft.eval()


def point_latest(link: Path, export_dir: Path) -> None:
    """`<output_dir>/latest` → the last exported draft (a relative symlink, replaced atomically)."""
    tmp = link.with_name(link.name + ".tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(export_dir, link.parent))
    os.replace(tmp, link)
