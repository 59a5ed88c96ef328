"""TRL's data set flags (utils.core.data_sources.HubDatasetFlags) on a local folder laid out as a hub data set repo
(configurations in its README, parquet files per split): --dataset_config, --dataset_train_split (--dataset_split is
its alias), --dataset_test_split for the held-out evaluation, and --dataset_streaming reading only the rows the run
uses."""

import json

import pytest

import train_grpo
import train_sft
from tests.launch_helpers import fresh_accelerate_state
from tiny.models import make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.core.config import ConfigError, parse_config
from utils.core.data_sources import load_hub_split
from utils.core.errors import DataValidationError
from utils.core.tracking import read_jsonl

README = """---
configs:
- config_name: color
  data_files:
  - split: train
    path: color/train-*.parquet
  - split: test
    path: color/test-*.parquet
- config_name: count
  data_files:
  - split: train
    path: count/train-*.parquet
---
"""


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory):
    """A data set repo with two configurations: 'color' (train 40 rows, test 6) and 'count' (train 40 rows)."""
    root = tmp_path_factory.mktemp("hub-dataset")
    for kind, splits in (("color", {"train": 40, "test": 6}), ("count", {"train": 40})):
        (root / kind).mkdir()
        for split, n in splits.items():
            rows = make_shapes_vqa(n, seed=len(split), kinds=(kind,))
            rows = rows.map(lambda row, i: {"id": f"{kind}-{split}-{i}"}, with_indices=True)
            rows.to_parquet(str(root / kind / f"{split}-00000.parquet"))
    (root / "README.md").write_text(README)
    return root


def test_a_configuration_and_split_read_and_a_stream_holds_only_its_first_rows(hub_repo):
    count = load_hub_split(hub_repo, config="count", split="train")
    assert len(count) == 40 and set(count["id"]) == {f"count-train-{i}" for i in range(40)}
    stream = load_hub_split(hub_repo, config="color", split="train", streaming=True, rows=7)
    assert stream["id"] == [f"color-train-{i}" for i in range(7)]
    assert stream[0]["image"].size == count[0]["image"].size  # images decode as in the whole read
    with pytest.raises(DataValidationError, match="configuration 'shape'.*Available: \\['color', 'count'\\]"):
        load_hub_split(hub_repo, config="shape", split="train")
    with pytest.raises(DataValidationError, match="split 'test' of configuration 'count'"):
        load_hub_split(hub_repo, config="count", split="test")


@pytest.mark.parametrize("flags, message", [
    (["--dataset_split", "a", "--dataset_train_split", "b"], "name different splits"),
    (["--dataset_streaming"], "--dataset_streaming reads only the rows the run uses: it needs --max_steps > 0"),
    (["--dataset_test_split", "test", "--eval_dataset_name", "x"], "give one of them"),
])
def test_data_set_flags_that_cannot_run_together_are_refused(flags, message):
    for config, validate in ((train_grpo.GRPOConfig, lambda c: train_grpo.validate(c, 1)),
                             (train_sft.SFTConfig, train_sft.validate)):
        with pytest.raises(ConfigError, match=message):
            validate(parse_config(config, flags))


def test_dataset_split_is_an_alias_of_dataset_train_split():
    from utils.core.data_sources import train_split

    assert train_split(parse_config(train_grpo.GRPOConfig, ["--dataset_split", "dev"])) == "dev"
    assert train_split(parse_config(train_grpo.GRPOConfig, ["--dataset_train_split", "dev"])) == "dev"
    assert train_split(parse_config(train_grpo.GRPOConfig, [])) == "train"


@pytest.mark.slow
def test_grpo_trains_on_a_streamed_configuration_and_evaluates_its_test_split(hub_repo, tmp_path):
    model = make_tiny_vlm(str(tmp_path / "qwen"), seed=0)
    cfg = train_grpo.GRPOConfig(
        model_name_or_path=model, dataset_name=str(hub_repo), dataset_config="color", dataset_streaming=True,
        dataset_test_split="test", eval_samples=4, eval_max_new_tokens=4, output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2, report_to="none",
        reward_funcs=["tests.grpo_helpers:completion_length"], log_completions=True, seed=0)
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    ids = {row["id"] for row in read_jsonl(tmp_path / "run" / "completions.jsonl")}
    # 2 steps x 2 prompts: drawn from the stream's first 4 rows of the color configuration only
    assert ids == {f"color-train-{i}" for i in range(4)}
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["heldout_samples_after"] == 4  # the test split of the same configuration


def test_sft_reads_a_configuration_and_streams_the_rows_its_steps_use(hub_repo):
    cfg = parse_config(train_sft.SFTConfig, ["--dataset_name", str(hub_repo), "--dataset_config", "count",
                                             "--dataset_streaming", "--max_steps", "3",
                                             "--per_device_train_batch_size", "2"])
    rows = train_sft.load_train_rows(cfg, cfg.dataset_name, num_processes=2)
    assert len(rows) == 3 * 2 * 2 and rows[0]["question"]
