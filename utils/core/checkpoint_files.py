"""What a checkpoint's files may hold, checked before resume loads any of them: no code runs from a checkpoint.

`training_state/` is written by `accelerator.save_state`, and under DeepSpeed by DeepSpeed's engine: torch pickles
(optimizer, scheduler, RNG states, DeepSpeed's model and optimizer shards) beside safetensors. accelerate reads a
registered object's state (`custom_checkpoint_N.pkl`, the LR scheduler) and DeepSpeed its engine files with
`torch.load(weights_only=False)`, which runs whatever a pickle names; accelerate skips an RNG file it cannot read
without a word. So before `load_state`:

- every pickle-bearing file is opened with `torch.load(weights_only=True)` and an allow-list of data types
  (`_safe_globals`: numpy arrays for the RNG states, DeepSpeed's loss scaler, ZeRO stage enum and fragment address):
  a file that names anything else is refused, naming it, and nothing in it runs; a file that passes holds only
  tensors, containers and those types, so the libraries' own loads of it run no code either;
- every safetensors file must read as one (its header parses);
- FSDP's sharded checkpoints (torch.distributed.checkpoint): its `.metadata`, a plain pickle DCP loads with
  `pickle.load`, is read first by an unpickler that resolves only DCP's own data classes, torch sizes, dtypes and
  layouts; its `.distcp` shards DCP reads with `weights_only=True` itself;
- every pickled file is compared with `manifest.json` (sha256 of each, written by `write_manifest` when the checkpoint
  was saved): a file changed, added or missing since the save is refused, naming it.

A checkpoint without manifest.json (written before it existed) gets the first check only. The manifest sits in the
checkpoint itself, so it tells a file altered after the save, not a checkpoint made whole elsewhere: that one is
held to the first check, which is what stops code. The work is shared out: file i is hashed and checked by process
i mod N, and every process raises the same refusal.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pickle
import sys
import zipfile
from pathlib import Path

import torch

from utils.core.errors import InputError

MANIFEST_NAME = "manifest.json"
NOT_PICKLED = (".safetensors", ".json", ".py")  # safetensors and JSON hold no code; zero_to_fp32.py is never run
PLAIN_FILES = ("latest",)  # DeepSpeed's tag file: one line of text


class UnsafeCheckpointError(InputError):
    """A checkpoint file that could run code on load, or that changed since its save; the message names it."""


def _safe_globals() -> list:
    """Data types a training state may name besides tensors and containers (torch allows those itself)."""
    import numpy as np
    from accelerate.utils.other import TORCH_SAFE_GLOBALS  # numpy arrays and dtypes of the RNG states

    types = list(TORCH_SAFE_GLOBALS) + [np.dtype]
    if "deepspeed" not in sys.modules:  # DeepSpeed's engine files are read only by a run that runs DeepSpeed
        return types
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        types += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    except ImportError:
        pass
    return types


def pickled_files(folder) -> list[Path]:
    """Every file under `folder` that a loader unpickles (all but safetensors, JSON, scripts and DeepSpeed's tag),
    sorted; the manifest itself excluded."""
    folder = Path(folder)
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME
                  and not p.name.endswith(NOT_PICKLED) and p.name not in PLAIN_FILES)


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def check_weights_only(path):
    """Refuse `path` unless it is a torch zip file whose pickle names only tensors, containers and `_safe_globals()`."""
    shown = str(path)
    if not zipfile.is_zipfile(path):
        raise UnsafeCheckpointError(f"{shown}: not a torch checkpoint file (a raw pickle or another format), "
                                    "refused: resume loads tensors and plain data only")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - any refusal of the weights-only unpickler
        reason = str(error).strip().splitlines()
        reason = next((line for line in reason if "GLOBAL" in line or "global" in line), reason[0] if reason else "")
        raise UnsafeCheckpointError(f"{shown}: refused, it holds more than tensors and plain data, so loading it "
                                    f"could run code ({reason.strip()[:200]}); a checkpoint runs no code on "
                                    "resume") from None


DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint.planner")
DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"), ("builtins", "set"),
               ("builtins", "frozenset"), ("_codecs", "encode")}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """FSDP's sharded checkpoints (torch.distributed.checkpoint): `.metadata` is a plain pickle that DCP loads with
    `pickle.load`. Only its own data classes and enums, torch sizes, dtypes and layouts, and paths resolve here."""

    def find_class(self, module, name):
        if module in DCP_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif (module, name) in DCP_GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def check_pickle(path):
    """Refuse `path` unless it is what a training state may hold: a torch zip file of tensors, containers and
    `_safe_globals()` (accelerate's and DeepSpeed's files), or DCP's metadata of data classes; DCP's `.distcp` shards
    are read by DCP itself with `weights_only=True`."""
    path = Path(path)
    if path.suffix == ".distcp":
        return
    if path.name == ".metadata" and not zipfile.is_zipfile(path):
        try:
            with open(path, "rb") as f:
                _DCPMetadataUnpickler(f).load()
        except Exception as error:  # noqa: BLE001 - any refusal: the file is not DCP's metadata
            raise UnsafeCheckpointError(f"{path}: refused, it holds more than DCP's checkpoint metadata, so loading "
                                        f"it could run code ({str(error)[:200]}); a checkpoint runs no code on "
                                        "resume") from None
        return
    check_weights_only(path)


def check_safetensors(path):
    """Refuse `path` unless its header reads as safetensors (which hold tensors and nothing else)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as error:  # noqa: BLE001 - whatever the parser says, the file is not what was saved
        raise UnsafeCheckpointError(f"{path}: not a safetensors file ({str(error)[:200]}), refused") from None


def _share(files, rank, world):
    return [f for i, f in enumerate(files) if i % world == rank]


def _gathered(accelerator, items: list) -> list:
    if accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


def fsync_tree(folder, files=None):
    """Flush the files (default: every file under `folder`) and the folders holding them to disk."""
    folder = Path(folder)
    files = list(files) if files is not None else [p for p in folder.rglob("*") if p.is_file()]
    for path in files:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    for directory in {folder, *(p.parent for p in files)}:
        fsync_dir(directory)


def fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(accelerator, folder):
    """Every process flushes and hashes its share of the files under `folder` (a checkpoint being saved, all its
    files written); the main process writes `folder/training_state/manifest.json`. Call on every process."""
    folder = Path(folder)
    state = folder / "training_state"
    pickled = set(pickled_files(state))
    mine = _share(sorted(p for p in folder.rglob("*") if p.is_file()), accelerator.process_index,
                  accelerator.num_processes)
    fsync_tree(folder, mine)
    hashed = _gathered(accelerator, [(str(p.relative_to(state)), sha256(p)) for p in mine if p in pickled])
    if accelerator.is_main_process:
        path = state / MANIFEST_NAME
        path.write_text(json.dumps({"sha256": dict(sorted(hashed))}, indent=1), encoding="utf-8")
        fsync_tree(state, [path])


def read_manifest(folder) -> dict | None:
    """{file relative to `folder`: sha256} of `folder/manifest.json`, None without one."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        hashes = json.loads(path.read_text(encoding="utf-8"))["sha256"]
        assert isinstance(hashes, dict)
        return hashes
    except (ValueError, KeyError, TypeError, AssertionError):
        raise UnsafeCheckpointError(f"{path}: not a manifest written by mmgrpo (unreadable), refused") from None


def verify_training_state(accelerator, folder):
    """Refuse (UnsafeCheckpointError naming the file, on every process) a `training_state/` folder that holds a
    file loading could run code from, or a file that differs from its manifest. Call on every process."""
    folder = Path(folder)
    files = pickled_files(folder)
    problems = []
    try:
        expected = read_manifest(folder)
    except UnsafeCheckpointError as refusal:
        expected, problems = None, [str(refusal)]
    if expected is not None:
        names = {str(p.relative_to(folder)) for p in files}
        problems += [f"{folder / name}: not in {MANIFEST_NAME} (added after the checkpoint was saved), refused"
                     for name in sorted(names - set(expected))]
        problems += [f"{folder / name}: listed in {MANIFEST_NAME} but missing, refused"
                     for name in sorted(set(expected) - names)]
    tensors = sorted(folder.rglob("*.safetensors"))
    for path in _share(files + tensors, accelerator.process_index, accelerator.num_processes):
        try:
            if path.suffix == ".safetensors":
                check_safetensors(path)
                continue
            name = str(path.relative_to(folder))
            if expected is not None and name in expected and sha256(path) != expected[name]:
                raise UnsafeCheckpointError(f"{path}: its sha256 differs from the one {MANIFEST_NAME} recorded when "
                                            "the checkpoint was saved (changed since), refused")
            check_pickle(path)
        except UnsafeCheckpointError as refusal:
            problems.append(str(refusal))
    problems = sorted(set(_gathered(accelerator, problems)))
    if problems:
        raise UnsafeCheckpointError(problems[0])
    if expected is None and accelerator.is_main_process:
        print(f"{folder}: no {MANIFEST_NAME} (a checkpoint from before manifests): its files were checked to hold "
              "tensors and plain data only", flush=True)
