"""Atomic, resumable checkpoints on top of `accelerate`.

Layout of ``output_dir/checkpoint-N/``:

    model.safetensors (+ index), config.json,   HF copy of the policy: `from_pretrained("checkpoint-N")` works,
    generation_config.json, processor files     `evaluate.py --model out/checkpoint-N` and the hub push use it
    trainer_state.json                          the trainer's own state (`extra_state`): global_step, sampler
                                                state, curriculum stage, metrics so far ... Written last.
    training_state/                             `accelerator.save_state`: model, optimizer, scheduler, grad
                                                scaler, RNG states of every rank (random_states_{rank}.pkl) and
                                                objects registered with `accelerator.register_for_checkpointing`

The HF copy and `training_state/` both hold weights on purpose: under ZeRO-3 the first is the gathered 16-bit
model and the second the sharded fp32 master weights that an exact resume needs.

Everything is first written to ``output_dir/.tmp-checkpoint-N``, flushed to disk (fsync) and renamed to
``checkpoint-N`` by the main process once every rank has finished, so neither a crash mid-save nor a power loss just
after it leaves a half checkpoint that `latest_checkpoint` would pick. The output dir must be on a file system shared
by all ranks (as accelerate itself assumes). `training_state/manifest.json` holds the sha256 of every pickled file,
and resume checks it and what each file may hold before loading any (utils/core/checkpoint_files.py); a checkpoint
is never written from NaN or infinite weights.

Data position: `save_state` does not know where a hand-written loop is in its data, so scripts keep a
`utils.core.samplers.SeededSampler` and store `sampler.state_dict()` in `extra_state` (or register the sampler with
`accelerator.register_for_checkpointing`). Together with the restored RNG states a resumed run draws the same
prompts and the same samples as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from utils.core.checkpoint_files import fsync_dir, fsync_tree, verify_training_state, write_manifest
from utils.core.config import config_to_dict
from utils.core.guards import RunStopped

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
TRAINING_STATE_DIR = "training_state"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


def _step_of(path: Path) -> int | None:
    match = _CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / TRAINER_STATE_NAME).is_file() and (path / TRAINING_STATE_DIR).is_dir()


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete `checkpoint-N` folders, oldest first (leftover `.tmp-checkpoint-*` are never listed)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and _step_of(p) is not None and is_complete_checkpoint(p)]
    return sorted(found, key=_step_of)


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    checkpoints = list_checkpoints(output_dir)
    return str(checkpoints[-1]) if checkpoints else None


def _checked_checkpoint(value, who: str) -> Path:
    path = Path(value).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{who}: checkpoint folder not found: {path}")
    if not is_complete_checkpoint(path):
        raise ValueError(
            f"{who}: {path} is not a complete checkpoint (needs {TRAINER_STATE_NAME} and "
            f"{TRAINING_STATE_DIR}/, written by utils.core.checkpoint.save_checkpoint)"
        )
    return path


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str | os.PathLike) -> str | None:
    """None/""/"none"/"false" -> None; "latest"/"true" -> newest complete checkpoint in output_dir (None if there is
    none yet, so a first run and its restart share one command line); anything else is a path that must exist."""
    value = resume_from_checkpoint
    if value is None or str(value).strip().lower() in ("", "none", "false", "no"):
        return None
    if str(value).strip().lower() in ("latest", "true", "yes"):
        return latest_checkpoint(output_dir)
    return str(_checked_checkpoint(value, "--resume_from_checkpoint"))


def _rmtree(path: Path):
    shutil.rmtree(path, ignore_errors=True)


def _json_safe(value):
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


def prune_checkpoints(output_dir: str | os.PathLike, save_total_limit: int, keep=()):
    """Delete the oldest complete checkpoints so at most `save_total_limit` remain; never deletes the paths in `keep`
    (the newest, and with train_grpo's --load_best_model_at_end the best so far, which HF's Trainer keeps beside the
    limit too)."""
    if save_total_limit < 1:
        raise ValueError(f"save_total_limit must be >= 1 or None, got {save_total_limit}")
    checkpoints = list_checkpoints(output_dir)
    keep_paths = {Path(p).resolve() for p in keep}
    removable = [p for p in checkpoints if p.resolve() not in keep_paths]
    excess = len(checkpoints) - save_total_limit
    for path in removable[: max(excess, 0)]:
        _rmtree(path)


def _find_pretrained(module) -> tuple[str, object | None]:
    """The outermost HF model (anything with save_pretrained: transformers, PEFT, diffusers) inside `module`,
    with its state-dict key prefix, so a script's wrapper (e.g. a log-prob head around the policy) still gets
    an HF-loadable copy."""
    for name, sub in module.named_modules():
        if hasattr(sub, "save_pretrained"):
            return (f"{name}." if name else ""), sub
    return "", None


def non_finite_weight(state_dict) -> str | None:
    """The name of the first floating tensor of `state_dict` that holds a NaN or an infinity, or None."""
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            return name
    return None


class NonFiniteWeightsError(RunStopped):
    """A checkpoint was asked for while a weight is NaN or infinite: none is written."""


def save_checkpoint(accelerator, output_dir, step: int, *, model, processor=None, extra_state: dict | None = None,
                    save_total_limit: int | None = None, extra_saves: dict | None = None, keep=()) -> str:
    """Save a resumable + HF-loadable checkpoint. Call on every rank (DeepSpeed's save and ZeRO-3's gather are
    collective). `extra_saves` ({subfolder: fn(folder)}, run on the main process) adds other loadable parts, e.g.
    a second model's adapter, inside the same atomic folder. `keep`: checkpoints --save_total_limit never deletes
    (besides this one). Returns the path of `checkpoint-{step}`.

    Refused (NonFiniteWeightsError on every rank, nothing written) when a weight is NaN or infinite. Every file is
    flushed to disk (fsync) before the rename, and `training_state/manifest.json` records the sha256 of each
    pickled file, which resume checks (utils/core/checkpoint_files.py)."""
    if save_total_limit is not None and save_total_limit < 1:  # fail before an expensive save, not after
        raise ValueError(f"save_total_limit must be >= 1 or None, got {save_total_limit}")
    output_dir = Path(output_dir)
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = output_dir / f"{TMP_PREFIX}{step}"
    # get_state_dict gathers ZeRO-3 shards (collective), so every rank calls it; only the main process checks and
    # writes
    state_dict = accelerator.get_state_dict(model)
    bad = non_finite_weight(state_dict) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        bad = broadcast_object_list([bad])[0]
    if bad is not None:
        raise NonFiniteWeightsError(f"step {step}: weight {bad!r} is not finite (NaN or inf): no checkpoint is "
                                    f"written from it (the last good one in {output_dir} stays)")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        for leftover in output_dir.glob(f"{TMP_PREFIX}*"):  # a crashed save from an earlier run
            _rmtree(leftover)
        tmp.mkdir()
    accelerator.wait_for_everyone()

    accelerator.save_state(str(tmp / TRAINING_STATE_DIR))
    prefix, pretrained = _find_pretrained(accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        if pretrained is not None:
            if prefix:
                state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            pretrained.save_pretrained(str(tmp), state_dict=state_dict, safe_serialization=True)
        if processor is not None:
            processor.save_pretrained(str(tmp))
        for name, save in (extra_saves or {}).items():
            save(str(tmp / name))
    del state_dict
    accelerator.wait_for_everyone()
    write_manifest(accelerator, tmp)  # every rank flushes and hashes its share of the files

    if accelerator.is_main_process:
        state = {"global_step": step, **_json_safe(extra_state or {})}
        # trainer_state.json last: its presence marks the folder complete
        (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
        fsync_tree(tmp, [tmp / TRAINER_STATE_NAME])
        if final.exists():  # re-saving the same step (e.g. after a resume): swap, then drop the old one
            old = output_dir / f"{TMP_PREFIX}{step}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            _rmtree(old)
        else:
            os.replace(tmp, final)
        fsync_dir(output_dir)  # the rename itself on disk
        if save_total_limit is not None:
            prune_checkpoints(output_dir, save_total_limit, keep=[final, *keep])
    accelerator.wait_for_everyone()
    return str(final)


def load_checkpoint(accelerator, path) -> dict:
    """Restore model/optimizer/scheduler/RNG (+ registered objects) into the prepared objects of `accelerator`
    and return the `extra_state` that was saved with the checkpoint (incl. "global_step"). Nothing in the
    checkpoint runs: its pickled files are checked first (utils/core/checkpoint_files.py), a refusal names the file."""
    path = _checked_checkpoint(path, "load_checkpoint")
    verify_training_state(accelerator, path / TRAINING_STATE_DIR)
    accelerator.load_state(str(path / TRAINING_STATE_DIR))
    return json.loads((path / TRAINER_STATE_NAME).read_text(encoding="utf-8"))


def save_and_push(accelerator, cfg, step, *, model, processor, state, logger, uploader, base_model, script,
                  extra_saves=None, keep=(), **card):
    """The step's checkpoint (atomic, `save_checkpoint`: the prepared `model`, optimizer, scheduler, RNG, the
    script's `state` and `extra_saves`; --save_total_limit kept, never deleting `keep`), then, with --push_to_hub, its
    upload in the background with the recipe, the last metrics and the model card's `base_model`, `script` and
    `card` extras. Returns the checkpoint's path."""
    path = save_checkpoint(accelerator, cfg.output_dir, step, model=model, processor=processor, extra_state=state,
                           save_total_limit=cfg.save_total_limit, extra_saves=extra_saves, keep=keep)
    if uploader:
        uploader.push(path, recipe=config_to_dict(cfg), metrics=logger.last_metrics, base_model=base_model,
                      script=script, **card)
    return path
