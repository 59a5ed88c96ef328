"""Where data rows come from: a hub name, a `save_to_disk` folder, a .json/.jsonl/.parquet file or a folder of such
files (files named after splits are picked by split), read into one `datasets.Dataset` (`load_table`), with the
bookkeeping that lets every error name the file and the row of the input (`Source`) and resolve relative paths
against the file that holds the row. The loaders of each format are `utils.core.data` and `utils.t2i.data`.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field

import datasets

from utils.core.errors import DataValidationError

DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
SPLIT_WORDS = ("train", "test", "validation", "val", "dev", "eval")


@dataclass
class Source:
    """Where a table's rows come from, for error messages that name the file and row, and relative paths."""

    label: str  # what error messages call the data: a file, a folder or a hub name
    base_dir: str | None  # relative image paths resolve against this (None: cannot resolve)
    files: list[tuple[str, int]] = field(default_factory=list)  # (file, rows) in concatenation order

    def _locate(self, row: int) -> tuple[str, int, str | None]:
        start = 0
        for path, count in self.files:
            if row < start + count:
                return path, row - start, os.path.dirname(os.path.abspath(path))
            start += count
        return self.label, row, self.base_dir

    def where(self, row: int) -> str:
        path, local_row, _ = self._locate(row)
        return f"{path} row {local_row}"

    def base_for(self, row: int) -> str | None:
        return self._locate(row)[2]

    def fail(self, row: int, column: str, message: str):
        raise DataValidationError(f"{self.where(row)}, column '{column}': {message}")


def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or os.path.splitext(name)[1].lower() in DATA_EXTENSIONS
            or name.count("/") >= 2 or os.sep != "/" and os.sep in name)


def _read_file(path: str) -> datasets.Dataset:
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_EXTENSIONS:
        raise DataValidationError(f"{path}: unsupported file type '{ext}'; expected one of {sorted(DATA_EXTENSIONS)}")
    if os.path.getsize(path) == 0:
        raise DataValidationError(f"{path}: the file is empty")
    try:
        return datasets.load_dataset(DATA_EXTENSIONS[ext], data_files=path, split="train")
    except Exception as error:  # datasets wraps parse errors in several exception types
        raise DataValidationError(f"{path}: could not be read as {ext[1:]}: {type(error).__name__}: {error}") from error


def _pick_split(data, split: str, label: str) -> datasets.Dataset:
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataValidationError(f"{label}: no split '{split}'; it has {sorted(data)} (set --split)")
        return data[split]
    return data


def _is_saved_dataset(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name))
               for name in ("dataset_dict.json", "state.json", "dataset_info.json"))


def _data_files(folder: str, split: str) -> list[str]:
    files = sorted(path for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True)
                   if os.path.splitext(path)[1].lower() in DATA_EXTENSIONS and os.path.isfile(path))
    if not files:
        raise DataValidationError(f"{folder}: neither a save_to_disk dataset nor a folder with "
                                  f"{'/'.join(sorted(DATA_EXTENSIONS))} files")

    def split_of(path):
        words = re.split(r"[\W_]+", os.path.splitext(os.path.relpath(path, folder))[0].lower())
        return next((word for word in words if word in SPLIT_WORDS), None)

    # Files named after splits (train.jsonl, data/test-0000.parquet) are picked by split; otherwise all.
    if any(split_of(path) for path in files):
        chosen = [path for path in files if split_of(path) == split]
        if not chosen:
            found = sorted({split_of(path) for path in files if split_of(path)})
            raise DataValidationError(f"{folder}: no files for split '{split}'; found splits {found} (set --split)")
        return chosen
    return files


def open_source(name_or_path, split: str = "train") -> tuple[datasets.Dataset, Source]:
    if isinstance(name_or_path, (datasets.Dataset, datasets.DatasetDict)):
        return _pick_split(name_or_path, split, "<in-memory dataset>"), Source("<in-memory dataset>", os.getcwd())
    name = os.fspath(name_or_path)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return _pick_split(datasets.load_from_disk(path), split, path), Source(path, os.path.abspath(path))
        files = _data_files(path, split)
        parts = [_read_file(file) for file in files]
        try:
            table = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
        except Exception as error:
            raise DataValidationError(f"{path}: its files do not share one schema ({error}); "
                                      f"files: {files}") from error
        return table, Source(path, os.path.abspath(path), [(f, len(p)) for f, p in zip(files, parts)])
    if os.path.isfile(path):
        table = _read_file(path)
        return table, Source(path, os.path.dirname(os.path.abspath(path)), [(path, len(table))])
    if _looks_like_path(name):
        raise DataValidationError(f"{name}: no such file or folder")
    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as error:
        raise DataValidationError(
            f"{name}: not a local file or folder, and loading it from the Hugging Face Hub failed "
            f"({type(error).__name__}: {(str(error).splitlines() or [''])[0]}). Check the name and split, the "
            f"network and HF_DATASETS_OFFLINE (a gated data set also needs its terms accepted on the hub and "
            f"`hf auth login`), or pass a save_to_disk folder or a .json/.jsonl/.parquet file."
        ) from error
    return table, Source(name, None)


@dataclass
class HubDatasetFlags:
    """The data set flags of TRL's scripts that GRPO and SFT share (their --dataset_split is --dataset_train_split's
    alias)."""

    # data: data set on the hub (TRL's names)
    dataset_config: str | None = field(default=None, metadata={"help": (
        "configuration (subset) of --dataset_name: a hub data set's, or a local folder's laid out as a hub repo "
        "(its README's configs); none: the default one")})
    dataset_train_split: str = field(default="train", metadata={"help": (
        "split of --dataset_name to train on (TRL's name; --dataset_split is its alias)")})
    dataset_test_split: str | None = field(default=None, metadata={"help": (
        "split of --dataset_name the held-out evaluation reads when --eval_dataset_name is not given (TRL's name); "
        "none: no evaluation from it")})
    dataset_streaming: bool = field(default=False, metadata={"help": (
        "stream --dataset_name's split and read only the rows the run uses (--max_steps' worth), for hub data sets "
        "too big to download")})


def train_split(cfg) -> str:
    """--dataset_train_split, or --dataset_split (its alias) where that is given."""
    return cfg.dataset_split or cfg.dataset_train_split


def dataset_flags_error(cfg) -> str | None:
    """The one-line reason the data set flags cannot run together, or None."""
    if cfg.dataset_split and cfg.dataset_train_split not in ("train", cfg.dataset_split):
        return (f"--dataset_split {cfg.dataset_split} and --dataset_train_split {cfg.dataset_train_split} name "
                "different splits (the first is the second's alias); give one")
    if cfg.dataset_streaming and not cfg.max_steps > 0:
        return "--dataset_streaming reads only the rows the run uses: it needs --max_steps > 0 (a stream has no epochs)"
    if cfg.dataset_test_split and cfg.eval_dataset_name:
        return ("--dataset_test_split names a split of --dataset_name for evaluation; --eval_dataset_name reads "
                "--eval_split of its own: give one of them")
    return None


def train_rows(cfg, path, rows=None):
    """What a script loads its training rows from: `path` as it is, or with --dataset_config / --dataset_streaming
    the split read by `load_hub_split` (`rows`: how many a stream must yield)."""
    if not (cfg.dataset_config or cfg.dataset_streaming):
        return path
    return load_hub_split(path, split=train_split(cfg), config=cfg.dataset_config, streaming=cfg.dataset_streaming,
                          rows=rows)


def eval_source(cfg, resolve=lambda name: name):
    """(where the held-out rows come from, its split): --eval_dataset_name and --eval_split, or --dataset_name's
    --dataset_test_split (with --dataset_config; a stream of --eval_samples rows under --dataset_streaming); (None,
    None) without either."""
    if cfg.eval_dataset_name:
        return resolve(cfg.eval_dataset_name), cfg.eval_split
    if not getattr(cfg, "dataset_test_split", None):
        return None, None
    name = resolve(cfg.dataset_name)
    if not (cfg.dataset_config or cfg.dataset_streaming):
        return name, cfg.dataset_test_split
    rows = load_hub_split(name, split=cfg.dataset_test_split, config=cfg.dataset_config,
                          streaming=cfg.dataset_streaming, rows=cfg.eval_samples or 1024)
    return rows, cfg.dataset_test_split


def load_hub_split(name_or_path, *, split: str = "train", config: str | None = None, streaming: bool = False,
                   rows: int | None = None) -> datasets.Dataset:
    """A split of a hub data set (or of a local folder laid out as a hub repo: data files, a README's `configs`) by
    configuration name (--dataset_config), read whole or streamed (--dataset_streaming): a stream downloads only the
    first `rows` rows of the split, in the data set's order, and holds them as a `datasets.Dataset` (the run's
    seeded sampler shuffles them like any other rows; a resumed run streams the same rows again)."""
    name = os.fspath(name_or_path)
    path = os.path.expanduser(name)
    if os.path.isdir(path) and _is_saved_dataset(path):
        raise DataValidationError(f"{name}: a save_to_disk folder has no configurations and is not streamed; drop "
                                  "--dataset_config and --dataset_streaming")
    if streaming and not rows:
        raise DataValidationError(f"{name}: a streamed split needs the number of rows to read (--max_steps > 0)")
    target = path if os.path.exists(path) else name
    try:
        data = datasets.load_dataset(target, config, split=split, streaming=streaming)
        if streaming:
            data = datasets.Dataset.from_list(list(data.take(rows)), features=data.features)
    except Exception as error:  # datasets raises several types for a missing config, split or file
        raise DataValidationError(
            f"{name}: could not read split '{split}'{f' of configuration {config!r}' if config else ''}"
            f"{' as a stream' if streaming else ''} ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
        ) from error
    if streaming and len(data) < rows:
        print(f"{name}: the stream of split '{split}' ended after {len(data)} rows (asked for {rows})")
    return data


def load_table(name_or_path, *, split: str = "train") -> datasets.Dataset:
    """A `datasets.Dataset` from a save_to_disk folder (Dataset or DatasetDict -> `split`), a
    .json/.jsonl/.parquet file, a folder of such files (files named after splits are picked by
    `split`), or a hub name (`datasets.load_dataset(name, split=split)`). Failures name the input."""
    return open_source(name_or_path, split)[0]
