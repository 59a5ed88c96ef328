"""One run per output folder: a lock held for the run's lifetime, and no fresh run beside another run's files.

Two runs writing one folder mix their checkpoints and logs: `latest` then resumes the other run, pruning deletes
its checkpoints, `evaluate.py --select_best` scores both. So:

- `hold_lock(folder)` takes an exclusive `flock` on `folder/.lock` (the holder's pid and host inside) and keeps
  it until `release` or the process ends, however it ends (the OS drops it, a SIGKILL included); a second run
  there stops at once, naming the holder. The train scripts hold their `--output_dir` (the main process; every
  process gets the refusal), iterate.py its own.
- `claim_output_dir` (the train scripts, right after the Accelerator, before any data or model loads) refuses a
  fresh run (no `--resume_from_checkpoint`) into a folder that holds a run (`run_marks`: checkpoints, metrics,
  config.yaml, train_summary.json), naming the folder and the two ways on: `--resume_from_checkpoint latest`, or
  `--overwrite_output_dir`, which deletes that run's files (`RUN_FILES`; nothing else in the folder) first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path

from utils.core.config import ConfigError

LOCK_FILE = ".lock"
# What a run writes into its output folder (globs); --overwrite_output_dir deletes these and nothing else.
RUN_FILES = ("checkpoint-*", ".tmp-checkpoint-*", "tmp-*", ".hub-staging", "metrics.jsonl", "completions.jsonl",
             "config.yaml", "train_summary.json", "*_curve.png", "heldout_*.png", "mmgrpo", "wandb", "trackio")
# Their presence means the folder holds a run.
RUN_MARKS = ("checkpoint-*", ".tmp-checkpoint-*", "metrics.jsonl", "config.yaml", "train_summary.json")
_HELD: dict[str, object] = {}  # folder -> the open lock file of this process


class FolderBusy(ConfigError):
    """Another process holds the folder's lock."""


def hold_lock(folder, what="run") -> object:
    """Take `folder/.lock` for as long as this process lives (or until `release(folder)`); raise FolderBusy naming the
    holder's pid and host when another process has it. A lock this process took earlier is taken again."""
    folder = os.path.abspath(folder)
    release(folder)  # an earlier run in this process (runs in one process follow each other) is over
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().split() or ["?", "?"]
        handle.close()
        pid, host = (owner + ["?"])[:2]
        raise FolderBusy(f"{path}: {folder} is in use by another {what} (pid {pid} on host {host}); wait for it to "
                         "finish or stop it, or give another --output_dir") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()} {socket.gethostname()}\n")
    handle.flush()
    _HELD[folder] = handle
    return handle


def release(folder):
    """Drop the lock this process holds on `folder` (the file stays: another process may already have it open)."""
    handle = _HELD.pop(os.path.abspath(folder), None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _matches(folder: Path, patterns) -> list[Path]:
    return sorted({p for pattern in patterns for p in folder.glob(pattern)})


def run_marks(folder) -> list[str]:
    """The names in `folder` that show a run was there (empty: none)."""
    folder = Path(folder)
    return [p.name for p in _matches(folder, RUN_MARKS)] if folder.is_dir() else []


def clear_run(folder):
    """Delete what a run wrote into `folder` (RUN_FILES), and nothing else."""
    for path in _matches(Path(folder), RUN_FILES):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def is_fresh(resume_from_checkpoint) -> bool:
    return resume_from_checkpoint is None or str(resume_from_checkpoint).strip().lower() in ("", "none", "false",
                                                                                             "no")


def claim_output_dir(accelerator, cfg):
    """The train scripts' claim on --output_dir, on every process before anything loads: the main process locks it
    and, for a fresh run, refuses it (or with --overwrite_output_dir clears it) when it holds another run; every
    process raises the same refusal."""
    folder = cfg.output_dir
    error = None
    if accelerator.is_main_process:
        try:
            hold_lock(folder)
            marks = run_marks(folder)
            if marks and is_fresh(cfg.resume_from_checkpoint):
                if getattr(cfg, "overwrite_output_dir", False):
                    accelerator.print(f"--overwrite_output_dir: deleting the earlier run in {folder} "
                                      f"({', '.join(marks[:4])}{', ...' if len(marks) > 4 else ''})")
                    clear_run(folder)
                else:
                    error = (f"--output_dir {folder} holds another run ({', '.join(marks[:4])}"
                             f"{', ...' if len(marks) > 4 else ''}); a fresh run there would mix with it. Resume "
                             "it with --resume_from_checkpoint latest, or start over with --overwrite_output_dir "
                             "(deletes that run's checkpoints and logs)")
        except ConfigError as refusal:
            error = str(refusal)
        if error:
            release(folder)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error:
        raise FolderBusy(error) if "is in use by" in error else ConfigError(error)
