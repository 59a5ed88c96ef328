"""Run logging shared by the train scripts: metrics.jsonl, completions.jsonl, trackers, a progress bar, plots.

Only the main process writes; every method is safe to call on all ranks (others do nothing), so scripts need no
`is_main_process` guard around logging. Metrics must already be reduced across ranks by the caller.

Trackers go through `accelerate`: create the Accelerator with
`Accelerator(log_with=tracker_list(cfg.report_to), project_dir=cfg.output_dir)`; RunLogger then calls
`init_trackers` with the run config and `accelerator.log` on every `log`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from utils.core.config import ConfigError, config_to_dict

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
SUMMARY_FILE = "train_summary.json"
KNOWN_TRACKERS = ("tensorboard", "wandb", "trackio")
DISPLAY_KEYS = ("reward", "loss", "kl")


def _tracker_installed(name: str) -> bool:
    from accelerate.utils import is_tensorboard_available, is_trackio_available, is_wandb_available

    return {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available,
            "trackio": is_trackio_available}[name]()


def tracker_list(report_to) -> list[str]:
    """Map `--report_to` ("tensorboard", "wandb", "trackio", "none", "all", or a list / comma-separated mix) to
    the `log_with` list for `Accelerator`. "all" means every known tracker that is installed."""
    if report_to is None:
        return []
    names = report_to if isinstance(report_to, (list, tuple)) else str(report_to).split(",")
    names = [n.strip().lower() for n in names if n.strip()]
    if not names or names == ["none"]:
        return []
    if "all" in names:
        return [n for n in KNOWN_TRACKERS if _tracker_installed(n)]
    result = []
    for name in names:
        if name not in KNOWN_TRACKERS:
            raise ConfigError(f"--report_to: unknown tracker {name!r}; choose from "
                             f"{', '.join(KNOWN_TRACKERS + ('all', 'none'))}")
        if not _tracker_installed(name):
            raise ConfigError(f"--report_to {name}: the {name!r} package is not installed "
                             f"(pip install {name}), or pass --report_to none")
        if name not in result:
            result.append(name)
    return result


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (list, dict, str)):
        return value.item()  # numpy scalars
    return value


def _hparams(config) -> dict:
    """Trackers (TensorBoard hparams in particular) accept only scalars; stringify the rest."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        config = config_to_dict(config)
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in config.items()}


def _truncate_jsonl(path: Path, start_step: int):
    """Keep rows logged at or before `start_step` (a resume re-logs the later ones); drop a torn last line."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] <= start_step:
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def _pick_display(metrics: dict, keys) -> dict:
    """reward/loss/kl, also when scripts namespace them ("train/reward")."""
    shown = {}
    for key in keys:
        for name, value in metrics.items():
            if (name == key or name.endswith("/" + key)) and isinstance(value, (int, float)):
                shown[key] = value
                break
    return shown


def _use_rich() -> bool:
    return sys.stdout.isatty() and not os.environ.get("CI")


class RunLogger:
    def __init__(self, output_dir, accelerator, *, report_to="tensorboard", config=None, total_steps: int,
                 start_step: int = 0, project_name: str = "mmgrpo", display_keys=DISPLAY_KEYS,
                 progress: bool | None = None):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.total_steps = int(total_steps)
        self.start_step = int(start_step)
        self.display_keys = tuple(display_keys)
        self.is_main = accelerator.is_main_process
        self._metrics_file = self._completions_file = None
        self._progress = None
        self._trackers_on = False
        self.last_metrics: dict | None = None  # the latest logged row without "step" (for summaries, cards)
        if not self.is_main:
            return

        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, COMPLETIONS_FILE):
            path = self.output_dir / name
            if self.start_step > 0:
                _truncate_jsonl(path, self.start_step)
            elif path.exists():
                path.unlink()  # a fresh run in an old output dir starts fresh logs
        self._metrics_file = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")
        self._completions_file = open(self.output_dir / COMPLETIONS_FILE, "a", encoding="utf-8")

        requested = tracker_list(report_to)
        if requested:
            if not getattr(accelerator, "log_with", None):
                raise ValueError(f"report_to={report_to!r} but the Accelerator was created without trackers: "
                                 f"use Accelerator(log_with=tracker_list(report_to), project_dir=output_dir)")
            accelerator.init_trackers(project_name, config=_hparams(config))
            self._trackers_on = True

        self._t0 = time.monotonic()
        if progress if progress is not None else _use_rich():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[info]}"))
            self._task = self._progress.add_task("train", total=self.total_steps, completed=self.start_step,
                                                 info="")
            self._progress.start()

    def log(self, step: int, metrics: dict):
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items() if k != "step"}}
        self.last_metrics = {k: v for k, v in row.items() if k != "step"}
        if not self.is_main:
            return
        self._metrics_file.write(json.dumps(row, default=str) + "\n")
        self._metrics_file.flush()
        if self._trackers_on:
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=int(step))
        shown = _pick_display(row, self.display_keys)
        info = "  ".join(f"{k} {v:.4g}" for k, v in shown.items())
        if self._progress is not None:
            self._progress.update(self._task, completed=int(step), info=info)
        else:
            done = max(int(step) - self.start_step, 0)
            per_step = (time.monotonic() - self._t0) / done if done else float("nan")
            eta = per_step * (self.total_steps - int(step)) if done else float("nan")
            print(f"step {int(step)}/{self.total_steps}  {info}  {per_step:.2f} s/step  eta {_format_duration(eta)}",
                  flush=True)

    def log_image(self, step: int, name: str, path):
        """An image file (a grid PNG) to the trackers that take images: TensorBoard and W&B (others skip it)."""
        if not (self.is_main and self._trackers_on and os.path.isfile(path)):
            return
        import numpy as np
        from PIL import Image

        image = Image.open(path).convert("RGB")
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({name: np.asarray(image)[None]}, step=int(step), dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({name: [image]}, step=int(step))

    def log_completions(self, step: int, rows: list[dict]):
        """One JSON line per sampled completion (prompt, completion, rewards ...) tagged with its step."""
        if not self.is_main:
            return
        for row in rows:
            self._completions_file.write(json.dumps({"step": int(step), **row}, default=str) + "\n")
        self._completions_file.flush()

    def close(self):
        if not self.is_main:
            return
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for handle in (self._metrics_file, self._completions_file):
            if handle is not None and not handle.closed:
                handle.close()
        if self._trackers_on:
            # not accelerator.end_training(): that also tears down the process group the script may still use
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self._trackers_on = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {number} is not valid JSON: {exc}") from None
    return rows


def _smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard-style debiased exponential moving average."""
    smoothed, last, norm = [], 0.0, 0.0
    for value in values:
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        smoothed.append(last / norm)
    return smoothed


def plot_reward_curve(metrics_jsonl, png_path, keys=("reward",), title=None, smoothing: float = 0.8) -> str:
    """Plot each key of metrics.jsonl against step: the raw curve faint, the smoothed one on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_jsonl)
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    series = {}
    for key in keys:
        points = [(r["step"], float(r[key])) for r in rows
                  if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and "step" in r]
        if points:
            series[key] = points
    if not series:
        available = sorted({k for r in rows for k in r if k != "step"})
        raise ValueError(f"{metrics_jsonl}: none of the keys {list(keys)} has a numeric value; "
                         f"available keys: {available}")
    fig, ax = plt.subplots(figsize=(7, 4))
    for index, (key, points) in enumerate(series.items()):
        steps, values = zip(*points)
        color = f"C{index}"
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
        ax.plot(steps, _smooth(list(values), smoothing), color=color, linewidth=2, label=key)
    ax.set_xlabel("step")
    ax.set_title(title or ", ".join(series))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return str(png_path)


def peak_memory_mb() -> float:
    """Peak CUDA memory allocated by this process if CUDA is in use, else the peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def train_summary(global_step, train_start, logger):
    """The start of train_summary.json (`write_summary`; a step of the run skeleton, utils.core.run): steps,
    seconds since `train_start` (time.perf_counter), peak memory and the last logged metrics. Taken before the
    final evaluation, whose results the script adds."""
    return dict(global_step=global_step, train_runtime=time.perf_counter() - train_start,
                peak_memory_mb=peak_memory_mb(), **(logger.last_metrics or {}))


def write_summary(output_dir, summary: dict) -> str:
    """train_summary.json: final metrics, timings, memory; read by benchmarks and the model card."""
    path = Path(output_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: _scalar(v) for k, v in summary.items()}
    path.write_text(json.dumps(clean, indent=2, sort_keys=True, default=str), encoding="utf-8")
    return str(path)
