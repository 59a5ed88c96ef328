"""Push checkpoints to the Hugging Face Hub without stalling training.

`HubUploader.push` links what belongs on the hub (weights, config, processor files; not the optimizer, RNG or
accelerate state) into a staging folder right away, so the run may go on writing and pruning its checkpoints, and
uploads that folder from a background thread. The train scripts stage inside their output folder
(`<output_dir>/.hub-staging/`): on the checkpoints' file system a hard link costs no copy, where a staging folder in
/tmp on another file system would copy the whole model. The repository is created private with `private=True`
(--hub_private_repo); the model card's recipe has its secrets redacted (utils/core/secrets.py). Upload errors are
logged when they happen and reported by `wait()` at the end of training. Create and use the uploader on the main
process only.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import logging as pylogging
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from huggingface_hub import HfApi

from utils.core.secrets import redact

logger = pylogging.getLogger(__name__)

# Top-level files of a checkpoint that make a loadable model; everything else (training_state/,
# trainer_state.json, optimizer/RNG files) stays local.
HUB_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "*.tiktoken", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.json", "chat_template.jinja",
    "adapter_config.json", "scheduler_config.json", "model_index.json",
    "*.py",  # remote-code models (InternVL ...) need their modeling/configuration files next to the weights
)
SCRIPT_TAGS = {"train_grpo.py": ["grpo", "reinforcement-learning"], "train_sft.py": ["sft"],
               "train_mixgrpo.py": ["grpo", "mix-grpo", "text-to-image"]}


class HubUploadError(RuntimeError):
    pass


def _belongs_on_hub(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in HUB_FILE_PATTERNS)


def _link_or_copy(src: Path, dst: Path):
    # a hard link costs no disk or time and survives the checkpoint being pruned before the upload ends
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _is_vision_model(folder: Path) -> bool:
    config_path = folder / "config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return "vision_config" in config or (folder / "preprocessor_config.json").is_file()


def _metric_cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_model_card(folder, *, base_model: str | list | None, recipe: dict | None, metrics: dict | None,
                     script: str | None, tags=(), model_name: str | None = None, notes: str | None = None) -> str:
    """README.md with hub metadata (front matter), the recipe, the final metrics and how to load the model.
    base_model: one model id, or a list for a model of several parts; notes: markdown added before how to load."""
    folder = Path(folder)
    script_name = Path(script).name if script else None
    card_tags = ["mmgrpo"] + SCRIPT_TAGS.get(script_name, []) + [t for t in tags if t]
    front = {"library_name": "transformers", "tags": list(dict.fromkeys(card_tags))}
    bases = [base_model] if isinstance(base_model, str) else list(base_model or [])
    if bases:
        front["base_model"] = bases[0] if len(bases) == 1 else bases
    vision = _is_vision_model(folder)
    model_cls, processor_cls = (("AutoModelForImageTextToText", "AutoProcessor") if vision
                                else ("AutoModelForCausalLM", "AutoTokenizer"))
    title = model_name or (f"{bases[0].split('/')[-1]} (mmgrpo)" if bases else "mmgrpo model")
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", f"# {title}", ""]
    trained = f"Trained with mmgrpo's `{script_name}`" if script_name else "Trained with mmgrpo"
    lines += [f"{trained}" + (", starting from " + ", ".join(f"`{b}`" for b in bases) + "." if bases else "."), ""]
    if recipe:
        lines += ["## Recipe", "", "```yaml", yaml.safe_dump(redact(recipe), sort_keys=False).strip(), "```", ""]
    if metrics:
        lines += ["## Final metrics", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {_metric_cell(value)} |" for name, value in metrics.items()]
        lines.append("")
    if notes:
        lines += [notes.strip(), ""]
    lines += ["## How to load", "", "```python", f"from transformers import {model_cls}, {processor_cls}", "",
              f'repo = "{model_name or "<repo id>"}"', f"model = {model_cls}.from_pretrained(repo)",
              f"processor = {processor_cls}.from_pretrained(repo)", "```", ""]
    path = folder / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def stage_for_hub(checkpoint_dir, staging_dir, *, recipe: dict | None = None, metrics: dict | None = None,
                  base_model: str | list | None = None, script: str | None = None, tags=(),
                  model_name: str | None = None, parts=(), notes: str | None = None) -> str:
    """Copy the hub-worthy files of `checkpoint_dir` into `staging_dir` and write its model card. `parts`: subfolders
    that go along whole (another model's weights, e.g. a generator's LoRA); each must exist."""
    checkpoint_dir, staging_dir = Path(checkpoint_dir), Path(staging_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"stage_for_hub: checkpoint folder not found: {checkpoint_dir}")
    files = [p for p in sorted(checkpoint_dir.iterdir()) if p.is_file() and _belongs_on_hub(p.name)]
    if not any(p.name.endswith(".safetensors") for p in files):
        raise FileNotFoundError(f"stage_for_hub: no *.safetensors weights in {checkpoint_dir} "
                                f"(point it at a checkpoint-N folder written by save_checkpoint)")
    missing = [name for name in parts if not (checkpoint_dir / name).is_dir()]
    if missing:
        raise FileNotFoundError(f"stage_for_hub: no {missing[0]}/ in {checkpoint_dir}")
    staging_dir.mkdir(parents=True, exist_ok=True)
    for path in files:
        _link_or_copy(path, staging_dir / path.name)
    for name in parts:
        shutil.copytree(checkpoint_dir / name, staging_dir / name, copy_function=_link_or_copy)
    write_model_card(staging_dir, base_model=base_model, recipe=recipe, metrics=metrics, script=script, tags=tags,
                     model_name=model_name, notes=notes)
    return str(staging_dir)


STAGING_DIR = ".hub-staging"


class HubUploader:
    def __init__(self, repo_id: str, *, token: str | None = None, private: bool = False, staging_root=None):
        """`staging_root`: the folder whose `.hub-staging/` holds the staged pushes (the run's output folder);
        None: the system's temporary folder."""
        self.repo_id = repo_id
        self.private = private
        self.staging_root = os.path.join(staging_root, STAGING_DIR) if staging_root is not None else None
        self.api = HfApi(token=token)
        # one worker: pushes land on the hub in the order they were made
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-upload")
        self._jobs: list[tuple[str, concurrent.futures.Future]] = []
        self._repo_created = False

    def push(self, checkpoint_dir, card: dict | None = None, *, recipe=None, metrics=None, base_model=None,
             script=None, commit_message: str | None = None, parts=(), notes=None) -> concurrent.futures.Future:
        """Stage now, upload in the background. `card` may carry recipe/metrics/base_model/script/tags instead of
        the keyword arguments; `parts` and `notes` as in `stage_for_hub`. The Future resolves to the upload's
        commit info or holds its error."""
        card = dict(card or {})
        if self.staging_root is not None:
            os.makedirs(self.staging_root, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="mmgrpo-hub-", dir=self.staging_root))
        try:
            stage_for_hub(checkpoint_dir, staging, recipe=recipe if recipe is not None else card.get("recipe"),
                          metrics=metrics if metrics is not None else card.get("metrics"),
                          base_model=base_model or card.get("base_model"), script=script or card.get("script"),
                          tags=card.get("tags", ()), model_name=self.repo_id, parts=parts, notes=notes)
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        message = commit_message or f"mmgrpo: upload {Path(checkpoint_dir).name}"
        future = self._pool.submit(self._upload, staging, message)
        self._jobs.append((str(checkpoint_dir), future))
        return future

    def _upload(self, staging: Path, message: str):
        try:
            if not self._repo_created:
                self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
                self._repo_created = True
            return self.api.upload_folder(repo_id=self.repo_id, folder_path=str(staging), commit_message=message)
        except Exception as exc:
            logger.error("push to the hub (%s) failed: %s: %s", self.repo_id, type(exc).__name__, exc)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def wait(self, raise_errors: bool = True) -> list:
        """Block until every push is done. Returns their results; raises HubUploadError listing the failed
        pushes (or, with raise_errors=False, returns the exceptions in their place)."""
        results, failures = [], []
        for checkpoint_dir, future in self._jobs:
            error = future.exception()
            results.append(error if error is not None else future.result())
            if error is not None:
                failures.append(f"{checkpoint_dir}: {type(error).__name__}: {error}")
        self._pool.shutdown(wait=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-upload")
        self._jobs = []
        if failures and raise_errors:
            raise HubUploadError(f"{len(failures)} push(es) to {self.repo_id} failed:\n" + "\n".join(failures))
        return results
