"""Validation-picked checkpoints: evaluate.py --select_best scores the run's start (--select_include, step 0) with
its checkpoints and keeps the earliest best; iterate.py --rl_eval_steps makes each RL stage checkpoint every N steps
and continues the cycle from the pick, and its report says which step. In-process: generation is replaced by
answers rigged per model, the training stages by folders of checkpoints."""

import json
import os

import pytest
import yaml

import evaluate
import iterate
from evaluate import EvalConfig
from iterate import IterateConfig, Runner
from utils.core.checkpoint import TRAINING_STATE_DIR
from utils.core.config import parse_config


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    from tests.distill_helpers import write_questions

    return write_questions(str(tmp_path_factory.mktemp("questions")), n=12)


def rig(monkeypatch, good):
    """evaluate.generate answers every row right for the models in `good`, wrong for any other."""
    def generate(cfg, model_path, rows):
        right = any(model_path == g or model_path.endswith(os.sep + g) for g in good)
        return [f"<think>I count.</think><answer>{r['answer'] if right else 'none'}</answer>" for r in rows]

    monkeypatch.setattr(evaluate, "generate", generate)


def _checkpoints(folder, steps):
    for step in steps:
        os.makedirs(folder / f"checkpoint-{step}")
        (folder / f"checkpoint-{step}" / "config.json").write_text("{}")


def test_select_include_is_step_zero_and_wins_ties(questions, tmp_path, monkeypatch):
    path = questions[0]
    run = tmp_path / "run"
    _checkpoints(run, [2, 4, 6])
    base = {"select_best": str(run), "select_include": ["start-model"], "dataset": path, "split": "train",
            "metrics": ["accuracy"], "output_dir": str(tmp_path / "pick")}
    rig(monkeypatch, good=["checkpoint-4", "checkpoint-6"])
    result = evaluate.main(EvalConfig(**base))
    assert (result["best_step"], os.path.basename(result["best_checkpoint"])) == (4, "checkpoint-4")  # ties: earliest
    assert result["steps"] == {"start-model": 0, **{str(run / f"checkpoint-{s}"): s for s in (2, 4, 6)}}
    rig(monkeypatch, good=["start-model", "checkpoint-6"])
    result = evaluate.main(EvalConfig(**base))
    assert (result["best_checkpoint"], result["best_step"], result["value"]) == ("start-model", 0, 1.0)
    saved = json.loads((tmp_path / "pick" / "best_checkpoint.json").read_text())
    assert saved["best_step"] == 0 and saved["scores"][str(run / "checkpoint-2")] == 0.0
    with pytest.raises(ValueError, match="--select_include adds candidates to --select_best"):
        evaluate.validate(EvalConfig(model="m", select_include=["x"]))


def test_select_guard_metric_picks_the_best_that_keeps_the_first_candidates_value(questions, tmp_path, monkeypatch):
    """CRYSTAL's final pick, 'the best Match F1 without losing accuracy', as --select_metric X --select_guard_metric Y:
    the best by X among the candidates whose Y is not below the first candidate's (minus the tolerance). Here X is
    format and Y accuracy, each answer rigged per model: checkpoint-2 formats every answer but gets none right (the
    best format, accuracy lost), checkpoint-4 and -6 keep the start's accuracy with better format (a tie: the
    earliest)."""
    path, rows = questions
    run = tmp_path / "run"
    _checkpoints(run, [2, 4, 6])
    n = len(rows)

    def answers(table):
        """evaluate.generate answering (rows answered in the JSON format, of them rows right) by model."""
        def generate(cfg, model_path, rows):
            answered, right = table[os.path.basename(model_path)]
            return [json.dumps({"reasoning_steps": ["I count."], "answer": r["answer"] if i < right else "none"})
                    if i < answered else "I do not know." for i, r in enumerate(rows)]
        monkeypatch.setattr(evaluate, "generate", generate)

    answers({"start-model": (6, 6), "checkpoint-2": (n, 0), "checkpoint-4": (9, 6), "checkpoint-6": (9, 6)})
    base = {"select_best": str(run), "select_include": ["start-model"], "dataset": path, "split": "train",
            "metrics": ["accuracy"], "select_metric": "format", "output_dir": str(tmp_path / "pick")}
    assert os.path.basename(evaluate.main(EvalConfig(**base))["best_checkpoint"]) == "checkpoint-2"  # unguarded
    result = evaluate.main(EvalConfig(**base, select_guard_metric="accuracy"))
    assert (os.path.basename(result["best_checkpoint"]), result["best_step"], result["value"]) == ("checkpoint-4", 4,
                                                                                                  0.75)
    guard = json.loads((tmp_path / "pick" / "best_checkpoint.json").read_text())["guard"]
    assert (guard["metric"], guard["floor"]) == ("accuracy", 0.5)
    assert [os.path.basename(p) for p in guard["eligible"]] == ["start-model", "checkpoint-4", "checkpoint-6"]
    # a tolerance of half the accuracy lets checkpoint-2 back in
    loose = evaluate.main(EvalConfig(**base, select_guard_metric="accuracy", select_guard_tolerance=0.5))
    assert os.path.basename(loose["best_checkpoint"]) == "checkpoint-2" and loose["guard"]["floor"] == 0.0
    # every checkpoint loses accuracy: the start itself is kept
    answers({"start-model": (6, 6), "checkpoint-2": (n, 5), "checkpoint-4": (9, 0), "checkpoint-6": (n, 1)})
    kept = evaluate.main(EvalConfig(**base, select_guard_metric="accuracy"))
    assert (kept["best_checkpoint"], kept["best_step"]) == ("start-model", 0)
    # refused in one line where the guard cannot apply
    for bad, message in [(dict(model="m", select_guard_metric="accuracy"), "give --select_best too"),
                         (dict(base, select_guard_tolerance=0.1), "give --select_guard_metric"),
                         (dict(base, select_guard_metric="accuracy", select_guard_tolerance=-0.1), "must be >= 0"),
                         (dict(base, select_guard_metric="format"), "is --select_metric itself"),
                         (dict(base, select_guard_metric="match_f1"), "needs 'crystal' in --metrics"),
                         (dict(base, select_guard_metric="recall"), "choose from")]:
        with pytest.raises(ValueError, match=message):
            evaluate.validate(EvalConfig(**bad))


def fake_stages(monkeypatch, launched):
    """Runner.run in this process: evaluate.py for real (its generation rigged), distill.py an empty set, a training
    stage the checkpoints its recipe says; each non-evaluation stage's recipe values go to `launched`."""
    def fake_run(self, name, folder, command, result=lambda: {}):
        if self.done(folder) is not None:
            return self.done(folder)
        recipe = command[-1]
        values = yaml.safe_load(open(recipe))
        if command[1].endswith("evaluate.py"):
            evaluate.main(parse_config(EvalConfig, ["--config", recipe]))
        elif command[1].endswith("distill.py"):
            launched[name] = values
            open(os.path.join(folder, "sft.jsonl"), "w").close()
            json.dump({"kept": 0}, open(os.path.join(folder, "summary.json"), "w"))
        else:  # a training stage: its checkpoints, where its recipe says
            launched[name] = values
            every, last = values.get("save_steps", 100), values.get("max_steps", 3)
            steps = sorted(set(range(every, last + 1, every)) | {last})
            for step in steps:
                ckpt = os.path.join(folder, f"checkpoint-{step}")
                os.makedirs(os.path.join(ckpt, TRAINING_STATE_DIR))
                open(os.path.join(ckpt, "config.json"), "w").write("{}")
                json.dump({"difficulty_levels": ["medium"] * 8, "step": step},
                          open(os.path.join(ckpt, "trainer_state.json"), "w"))
        return Runner.mark(name, folder, 0.0, result())

    monkeypatch.setattr(Runner, "run", fake_run)
    monkeypatch.setattr(Runner, "forward_signals", lambda self: None)


def test_each_rl_stage_continues_from_its_validation_pick(questions, tmp_path, monkeypatch):
    path, rows = questions
    run = tmp_path / "run"
    launched = {}

    fake_stages(monkeypatch, launched)
    # the medium stage is best at step 2 (of 2, 4, 5); the hard stage never beats its start
    rig(monkeypatch, good=[os.path.join("grpo-medium", "checkpoint-2")])
    grpo = {"max_steps": 5, "difficulty_samples": 1}
    distill = dict(dataset=path, caption_column="caption", captioner=None, reasoner_base_url="http://127.0.0.1:9/v1")
    cfg = IterateConfig(num_cycles=2, next_data_serve=True, base_model=str(tmp_path / "base"), output_dir=str(run),
                        rl_dataset=path, rl_samples=8, eval_dataset=path, eval_split="train", eval_samples=4,
                        rl_eval_steps=2, val_samples=3, distill=distill, grpo_medium=grpo, grpo_hard=grpo,
                        evaluate={"metrics": ["accuracy", "keywords"]})
    report = iterate.main(cfg)

    medium_pick = str(run / "cycle-1" / "grpo-medium" / "checkpoint-2")
    assert launched["cycle-1/grpo-medium"]["save_steps"] == 2 and launched["cycle-1/grpo-medium"]["save_total_limit"] \
        is None
    assert launched["cycle-1/grpo-hard"]["model_name_or_path"] == medium_pick  # continued from the pick
    # the difficulty estimate still comes from the medium stage's last checkpoint (the only one that holds all of it)
    hard_data = launched["cycle-1/grpo-hard"]["dataset_name"]
    assert hard_data == str(run / "cycle-1" / "grpo-hard-data")
    picked = report["cycles"][0]["picked"]
    assert picked["grpo-medium"]["step"] == 2 and picked["grpo-medium"]["steps"] == {"0": 0.0, "2": 1.0, "4": 0.0,
                                                                                      "5": 0.0}
    assert picked["grpo-hard"] == {"step": 0, "best_checkpoint": medium_pick, "value": 1.0,
                                   "steps": {"0": 1.0, "2": 0.0, "4": 0.0, "5": 0.0}}
    # the held-out evaluation of each stage is of the model the cycle continues from
    stages = report["cycles"][0]["stages"]
    assert (stages["grpo-medium"]["accuracy"], stages["grpo-hard"]["accuracy"]) == (1.0, 1.0)
    # the validation rows are the 3 rows right after the 8 RL rows of the same split, never trained on
    # cycle 2's new rows: the model cycle 1 ended with (the hard stage's pick), served by `transformers serve`
    regenerate = launched["cycle-2/data (new rows)"]
    assert (regenerate["chain_source"], regenerate["model"], regenerate["model_serve"]) == ("model", medium_pick, True)
    assert launched["cycle-2/grpo-hard"]["model_name_or_path"] == str(run / "cycle-2" / "grpo-medium" / "checkpoint-2")
    import datasets

    val = datasets.load_from_disk(str(run / "val-data"))
    assert val["id"] == [r["id"] for r in rows[8:11]]
    assert json.loads((run / "report.json").read_text())["cycles"][0]["picked"]["grpo-medium"]["step"] == 2


def test_benchmark_stages_score_the_base_and_each_cycles_final_model_by_each_benchmarks_rules(questions, tmp_path,
                                                                                                monkeypatch):
    """OpenVLThinker's evaluation: every stage on MathVista (--eval_benchmark: its prompts and scorer), the base model
    and each cycle's final model also on MathVerse and MATH-Vision (--eval_benchmarks), all local copies in the
    releases' own formats; the RL stages' validation picks stay on the validation rows, without a benchmark."""
    from tests.benchmark_helpers import write_mathverse, write_mathvision, write_mathvista

    path, _ = questions
    run, launched = tmp_path / "run", {}
    sets = {}
    for name, write in (("mathvista", write_mathvista), ("mathverse", write_mathverse),
                        ("mathvision", write_mathvision)):
        (tmp_path / name).mkdir()
        sets[name] = write(tmp_path / name)
    fake_stages(monkeypatch, launched)
    rig(monkeypatch, good=[os.path.join("grpo-hard", "checkpoint-4")])
    grpo = {"max_steps": 5, "difficulty_samples": 1}
    distill = dict(dataset=path, caption_column="caption", captioner=None, reasoner_base_url="http://127.0.0.1:9/v1")
    cfg = IterateConfig(num_cycles=1, base_model=str(tmp_path / "base"), output_dir=str(run), rl_dataset=path,
                        rl_samples=8, rl_eval_steps=2, val_samples=3, distill=distill, grpo_medium=grpo,
                        grpo_hard=grpo, evaluate={"metrics": ["accuracy", "keywords"]},
                        eval_dataset=sets["mathvista"], eval_split="testmini", eval_benchmark="mathvista",
                        eval_benchmarks={"mathverse": {"benchmark": "mathverse", "dataset": sets["mathverse"]},
                                         "mathvision": {"benchmark": "mathvision", "dataset": sets["mathvision"],
                                                        "max_samples": 3}})
    report = iterate.main(cfg)

    recipe = lambda folder: yaml.safe_load((run / folder / "recipe.yaml").read_text())  # noqa: E731
    assert (recipe("eval-base")["benchmark"], recipe("eval-base")["dataset"]) == ("mathvista", sets["mathvista"])
    assert recipe("eval-base-mathvision")["max_samples"] == 3 and recipe("eval-base-mathverse")["max_samples"] is None
    assert recipe(os.path.join("cycle-1", "eval-grpo-hard-mathverse"))["model"] == str(
        run / "cycle-1" / "grpo-hard" / "checkpoint-4")  # the cycle's final model: the hard stage's pick
    assert "benchmark" not in recipe(os.path.join("cycle-1", "grpo-medium-pick"))  # validation rows, not a benchmark
    # the base answers "none" to everything, the final model each benchmark's gold answer: every rule accepts it
    assert report["base"]["accuracy"] == 0.0 and report["cycles"][0]["stages"]["grpo-hard"]["accuracy"] == 1.0
    assert {b: m["accuracy"] for b, m in report["base"]["benchmarks"].items()} == {"mathverse": 0.0, "mathvision": 0.0}
    final = report["cycles"][0]["benchmarks"]
    assert {b: (m["accuracy"], m["samples"]) for b, m in final.items()} == {"mathverse": (1.0, 3),
                                                                             "mathvision": (1.0, 3)}
    assert final["mathverse"]["accuracy/problem_version=Vision Only"] == 1.0  # the benchmark's own breakdown
    metrics = json.loads((run / "cycle-1" / "eval-grpo-hard-mathverse" / "metrics.json").read_text())
    assert metrics["benchmark"] == "mathverse"
    assert not (run / "cycle-1" / "eval-sft-mathverse").exists()  # the intermediate stages: MathVista only


def test_benchmark_stages_are_checked_before_any_stage_runs(questions, tmp_path, monkeypatch):
    path, _ = questions
    distill = dict(dataset=path, caption_column="caption", captioner=None, reasoner_base_url="http://127.0.0.1:9/v1")
    monkeypatch.setattr(Runner, "forward_signals", lambda self: None)
    for benchmarks, message in [({"mv": {"benchmark": "mathvistaa", "dataset": path}}, "--benchmark 'mathvistaa'"),
                                ({"a/b": {"dataset": path}}, "names folders"),
                                ({"mv": {"benchmark": "mathverse"}}, "with a dataset"),
                                ({"mv": {"dataset": path, "splitt": "x"}}, "unknown key 'splitt'")]:
        out = tmp_path / str(len(message))
        with pytest.raises(ValueError, match=message):
            iterate.main(IterateConfig(output_dir=str(out), rl_dataset=path, distill=distill,
                                       eval_benchmarks=benchmarks))
        assert not (out / "eval-base").exists()
    with pytest.raises(ValueError, match="--benchmark 'mathvist'"):
        iterate.main(IterateConfig(output_dir=str(tmp_path / "x"), rl_dataset=path, distill=distill,
                                   eval_benchmark="mathvist"))


@pytest.mark.slow
@pytest.mark.full
def test_two_real_cycles_killed_mid_sft_resume_pick_on_validation_and_regenerate_served(distill_world, tmp_path):
    """The micro cycle of tests/test_iterate.py, really run, in an environment of requirements.txt's packages alone
    (tests/requirements_env.py). iterate.py alone is SIGKILLed (kill -9 <its pid>) in cycle 1's SFT: its stage's
    whole process tree ends within seconds, and a rerun resumes the SFT from its checkpoint without redoing the
    finished stages. Each RL stage checkpoints every step, is scored on the validation rows (its start included),
    the cycle goes on from the pick, and cycle 2's new rows come from cycle 1's model served by `transformers
    serve`."""
    import subprocess
    import time

    from tests.launch_helpers import finish, sigkill_when
    from tests.requirements_env import closure, make_view_venv, pinned
    from tests.test_iterate import REPO, _micro_recipe
    from utils.core.launch import _start_time, stage_processes

    python = make_view_venv(str(tmp_path / "venv"), closure(pinned()))
    values = _micro_recipe(distill_world, tmp_path)
    values.update(rl_eval_steps=1, val_samples=4, rl_samples=9, next_data_serve=True)
    recipe = tmp_path / "cycles.yaml"
    recipe.write_text(yaml.safe_dump(values))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def launch():
        return subprocess.Popen([python, os.path.join(REPO, "iterate.py"), "--config", str(recipe)], cwd=REPO,
                                env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    run = tmp_path / "run"
    victim = launch()
    stage = f"{victim.pid}:{_start_time(victim.pid)}"  # what iterate.py puts in its stages' environment
    sigkill_when(victim, run / "cycle-1" / "sft" / "checkpoint-2", timeout=900, poll=0.1, whole_session=False)
    deadline = time.time() + 10
    while stage_processes(stage) and time.time() < deadline:
        time.sleep(0.2)
    assert not stage_processes(stage), f"stage processes outlived iterate.py: {stage_processes(stage)}"
    assert not (run / "cycle-1" / "sft" / "stage.json").exists(), "the kill came after the stage had finished"
    finished = {p: (p.read_text(), p.stat().st_mtime) for p in (run / "eval-base" / "stage.json",
                                                                run / "cycle-1" / "data" / "stage.json")}

    out = finish(launch(), timeout=2400, what="iterate.py after the kill")
    assert "[iterate] eval-base: finished earlier" in out and "[iterate] cycle-1/data: finished earlier" in out
    assert {p: (p.read_text(), p.stat().st_mtime) for p in finished} == finished  # never redone
    assert "resumed from" in (run / "cycle-1" / "sft" / "stage.log").read_text()  # from its last checkpoint
    report = json.loads((run / "report.json").read_text())
    assert [c["cycle"] for c in report["cycles"]] == [1, 2] and (run / "report.png").exists()
    for cycle in report["cycles"]:
        assert set(cycle["stages"]) == {"sft", "grpo-medium", "grpo-hard"}
        assert all(0.0 <= s["accuracy"] <= 1.0 for s in cycle["stages"].values())
        assert set(cycle["picked"]) == {"grpo-medium", "grpo-hard"}
        for stage_name, pick in cycle["picked"].items():
            assert set(pick["steps"]) == {"0", "1", "2"} and pick["value"] == max(pick["steps"].values())
            assert f"{stage_name} picked step {pick['step']}" in out
    hard = yaml.safe_load((run / "cycle-1" / "grpo-hard" / "recipe.yaml").read_text())
    assert hard["model_name_or_path"] == report["cycles"][0]["picked"]["grpo-medium"]["best_checkpoint"]
    # cycle 2: half its SFT rows kept from cycle 1, its SFT from the base model, the cross-cycle claims
    assert report["cycles"][1]["data"]["mix"]["from_previous"] == 3
    assert set(report["claims"]) == {"each_sft_above_base", "last_rl_above_first_rl", "rl_above_previous_cycle_rl"}
    for cycle in ("cycle-1", "cycle-2"):
        sft = yaml.safe_load((run / cycle / "sft" / "recipe.yaml").read_text())
        assert sft["model_name_or_path"] == values["base_model"]
    regenerate = yaml.safe_load((run / "cycle-2" / "data" / "new" / "recipe.yaml").read_text())
    assert regenerate["model"] == report["cycles"][0]["picked"]["grpo-hard"]["best_checkpoint"]
    assert regenerate["model_serve"] and (run / "cycle-2" / "data" / "new" / "model_server.log").exists()
