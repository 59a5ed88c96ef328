"""iterate.py's resume cannot silently change a half-done stage: an unfinished stage whose flags differ from the
ones it started with is refused, naming them (--restart_stage starts it over), and a reused RL-data folder whose
rows were chosen with another --rl_samples is refused. In-process: the stages' commands are not run."""

import json
import os

import pytest
import yaml

import iterate
from iterate import IterateConfig, Runner
from utils.core.config import ConfigError


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    from tests.distill_helpers import write_questions

    return write_questions(str(tmp_path_factory.mktemp("questions")), n=12)[0]


def test_an_unfinished_stage_with_other_flags_is_refused_or_restarted(tmp_path):
    import train_sft

    folder = tmp_path / "cycle-1" / "sft"
    values = {"model_name_or_path": "base", "learning_rate": 1e-3, "max_steps": 4, "output_dir": str(folder)}
    iterate.start_stage("cycle-1/sft", str(folder), values, train_sft.SFTConfig)
    (folder / "checkpoint-2").mkdir()  # half a run of those flags
    iterate.start_stage("cycle-1/sft", str(folder), dict(values), train_sft.SFTConfig)  # same flags: resumes
    changed = {**values, "learning_rate": 2e-3, "max_steps": 8}
    with pytest.raises(ConfigError, match=r"stage cycle-1/sft .* unfinished.*--learning_rate: 0.001 -> 0.002; "
                                          r"--max_steps: 4 -> 8.*--restart_stage"):
        iterate.start_stage("cycle-1/sft", str(folder), changed, train_sft.SFTConfig)
    assert (folder / "checkpoint-2").exists()
    assert yaml.safe_load((folder / "recipe.yaml").read_text())["learning_rate"] == 1e-3  # untouched
    iterate.start_stage("cycle-1/sft", str(folder), changed, train_sft.SFTConfig, restart=True)
    assert sorted(os.listdir(folder)) == ["recipe.yaml"]  # started over: the old checkpoints are gone
    assert yaml.safe_load((folder / "recipe.yaml").read_text())["max_steps"] == 8


def _config(questions, tmp_path, **over):
    values = dict(num_cycles=1, base_model=str(tmp_path / "base"), output_dir=str(tmp_path / "run"),
                  rl_dataset=questions, rl_samples=8, eval_dataset=questions, eval_split="train", eval_samples=4,
                  distill=dict(dataset=questions, caption_column="caption", captioner=None,
                               reasoner_base_url="http://127.0.0.1:9/v1", temperature=1.0),
                  evaluate=dict(metrics=["accuracy"], max_new_tokens=16))
    values.update(over)
    return IterateConfig(**values)


@pytest.fixture
def crash_in(monkeypatch):
    """Runner.run that finishes the stages named in `finished` (stage.json, no command run) and is killed in any
    other; the recipes it was handed are in `seen`."""
    state = {"finished": set(), "seen": []}

    def run(self, name, folder, command, result=lambda: {}):
        record = self.done(folder)
        if record is not None:
            return record
        state["seen"].append((name, yaml.safe_load(open(command[-1]))))
        if name in state["finished"]:
            return Runner.mark(name, folder, 0.0, {})
        raise SystemExit(f"killed in {name}")

    monkeypatch.setattr(Runner, "run", run)
    monkeypatch.setattr(Runner, "forward_signals", lambda self: None)
    return state


def test_main_refuses_a_changed_half_done_stage_and_restart_stage_starts_it_over(questions, tmp_path, crash_in):
    crash_in["finished"] = {"eval-base"}
    with pytest.raises(SystemExit, match="killed in cycle-1/data"):
        iterate.main(_config(questions, tmp_path))
    data = tmp_path / "run" / "cycle-1" / "data"
    (data / "sft.jsonl").write_text('{"id": "a"}\n')  # rows distilled at temperature 1.0
    with pytest.raises(ConfigError, match=r"stage cycle-1/data .*--temperature: 1.0 -> 0.5"):
        iterate.main(_config(questions, tmp_path, distill={**_config(questions, tmp_path).distill,
                                                           "temperature": 0.5}))
    # a finished stage is never checked again: eval-base's flags changed, it is skipped all the same
    calls = len(crash_in["seen"])
    with pytest.raises(SystemExit, match="killed in cycle-1/data"):
        iterate.main(_config(questions, tmp_path, evaluate={"metrics": ["accuracy"], "max_new_tokens": 32}))
    assert [name for name, _ in crash_in["seen"][calls:]] == ["cycle-1/data"]
    with pytest.raises(SystemExit, match="killed in cycle-1/data"):
        iterate.main(_config(questions, tmp_path, restart_stage=True,
                             distill={**_config(questions, tmp_path).distill, "temperature": 0.5}))
    assert not (data / "sft.jsonl").exists()
    assert crash_in["seen"][-1] == ("cycle-1/data", {**crash_in["seen"][-1][1], "temperature": 0.5})


def test_a_reused_rl_data_folder_chosen_with_other_rows_is_refused(questions, tmp_path, crash_in):
    with pytest.raises(SystemExit, match="killed in eval-base"):
        iterate.main(_config(questions, tmp_path))
    import datasets

    rl_data = tmp_path / "run" / "rl-data"
    assert len(datasets.load_from_disk(str(rl_data))) == 8
    assert json.loads((rl_data / iterate.SOURCE_FILE).read_text())["rl_samples"] == 8
    with pytest.raises(ConfigError, match=r"rl-data holds rows chosen with other flags \(--rl_samples: 8 -> 6\)"):
        iterate.main(_config(questions, tmp_path, rl_samples=6))
    with pytest.raises(ConfigError, match=r"--rl_dataset: .* -> 'other.jsonl'; --rl_samples: 8 -> None"):
        iterate.write_rl_data(_config(questions, tmp_path, rl_dataset="other.jsonl", rl_samples=None), str(rl_data))
    with pytest.raises(SystemExit, match="killed in eval-base"):  # the same flags: reused
        iterate.main(_config(questions, tmp_path))
