"""iterate.py: stage recipes, the next cycle's SFT set, the runner's never-twice rule, the report, and a whole
two-cycle run on tiny models that is SIGKILLed mid-stage and resumed."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import yaml

import iterate
from iterate import IterateConfig, Runner, mix_sft_sets, stage_recipe, write_recipe
from utils.core.config import ConfigError, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(folder, prefix, n):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "sft.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{prefix}{i}", "messages": [], "images": [f"images/{prefix}{i}.png"]}) + "\n")
    return path


def test_mix_keeps_the_share_of_the_previous_set_and_rebases_image_paths(tmp_path):
    previous = _rows(tmp_path / "cycle-1" / "data", "old", 20)
    new = _rows(tmp_path / "cycle-2" / "data" / "new", "new", 10)
    out = tmp_path / "cycle-2" / "data" / "sft.jsonl"
    counts = mix_sft_sets(previous, new, 10, 0.7, seed=3, out_file=str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert counts == {"rows": 10, "from_previous": 7, "new": 3}
    assert [r["id"].startswith("old") for r in rows] == [True] * 7 + [False] * 3
    assert len({r["id"] for r in rows}) == 10
    old = next(r for r in rows if r["id"].startswith("old"))
    assert old["images"] == [os.path.join("..", "..", "cycle-1", "data", "images", old["id"] + ".png")]
    assert rows[-1]["images"] == [os.path.join("new", "images", rows[-1]["id"] + ".png")]
    # seeded: the same draw every time, another seed another draw
    again = tmp_path / "again.jsonl"
    mix_sft_sets(previous, new, 10, 0.7, seed=3, out_file=str(again))
    assert [json.loads(line)["id"] for line in again.read_text().splitlines()] == [r["id"] for r in rows]
    mix_sft_sets(previous, new, 10, 0.7, seed=4, out_file=str(again))
    assert [json.loads(line)["id"] for line in again.read_text().splitlines()] != [r["id"] for r in rows]
    # too few new rows: the set is smaller, never padded with repeats
    assert mix_sft_sets(previous, new, 40, 0.5, seed=0, out_file=str(again)) == {"rows": 30, "from_previous": 20,
                                                                               "new": 10}


def test_stage_recipe_order_and_checks(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"learning_rate": 1e-5, "max_steps": 10, "seed": 1}))
    merged = stage_recipe(str(recipe), {"max_steps": 20}, {"output_dir": "x"}, defaults={"seed": 7, "logging_steps": 3})
    assert merged == {"seed": 1, "logging_steps": 3, "learning_rate": 1e-5, "max_steps": 20, "output_dir": "x"}
    # the cycle's seed beats the recipe file's (--seed repeats the whole cycle), the user's own override beats both
    assert stage_recipe(str(recipe), {}, {}, cycle={"seed": 7})["seed"] == 7
    assert stage_recipe(str(recipe), {"seed": 3}, {}, cycle={"seed": 7})["seed"] == 3
    import train_sft

    cfg = write_recipe(merged, str(tmp_path / "stage" / "recipe.yaml"), train_sft.SFTConfig)
    assert (cfg.max_steps, cfg.output_dir) == (20, "x")
    with pytest.raises(ConfigError, match=r"stage/recipe.yaml.*unknown key 'max_step'"):
        write_recipe({"max_step": 3}, str(tmp_path / "stage" / "recipe.yaml"), train_sft.SFTConfig)
    with pytest.raises(ValueError, match="recipe file not found: nope.yaml"):
        stage_recipe("nope.yaml", {}, {})


def test_a_finished_stage_is_never_run_again(tmp_path):
    runner = Runner(IterateConfig())
    marker = tmp_path / "ran.txt"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x')"]
    first = runner.run("s", str(tmp_path / "s"), command, result=lambda: {"n": 1})
    second = runner.run("s", str(tmp_path / "s"), command, result=lambda: {"n": 2})
    assert marker.read_text() == "x" and first["n"] == second["n"] == 1
    with pytest.raises(SystemExit, match=r"stage bad failed \(exit code 3\).*run the same command again"):
        runner.run("bad", str(tmp_path / "bad"), [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert not (tmp_path / "bad" / "stage.json").exists()


def test_a_second_runner_on_a_busy_folder_stops_before_writing_anything(tmp_path):
    """Two iterate.py (or arms runners) on one folder would run the same stage twice at once: the second stops,
    naming the lock and the first one's pid; a killed runner's lock is gone with it (the OS drops it)."""
    folder = str(tmp_path / "run")
    code = ("import sys, time; import iterate; runner = iterate.Runner(iterate.IterateConfig()); "
            "runner.hold(sys.argv[1]); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, folder], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=rf"run/.lock: .*run is in use by another iterate run \(pid {holder.pid} "
                                             rf"on host {re.escape(socket.gethostname())}\)"):
            iterate.main(IterateConfig(output_dir=folder, distill={"reasoner_base_url": "http://127.0.0.1:9/v1"}))
        assert os.listdir(folder) == [".lock"]  # no config.yaml written over the first run's
    finally:
        holder.kill()
        holder.wait()
    runner = Runner(IterateConfig())
    runner.hold(folder)
    assert open(os.path.join(folder, ".lock")).read().split() == [str(os.getpid()), socket.gethostname()]
    runner.release()


def test_a_stage_runs_where_iterate_was_started(tmp_path, monkeypatch):
    """Relative --output_dir, data and recipe paths are the caller's: a stage started from another folder than
    the repository writes its relative paths there, beside the folder iterate.py itself writes."""
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "-c", "import os; open(os.path.join('out', 's', 'child.txt'), 'w').write('x')"]
    Runner(IterateConfig()).run("s", os.path.join("out", "s"), command)
    assert (tmp_path / "out" / "s" / "child.txt").read_text() == "x"
    assert (tmp_path / "out" / "s" / "stage.json").exists()


def test_bad_settings_fail_before_any_stage(tmp_path):
    with pytest.raises(ValueError, match="--keep_previous must be in"):
        iterate.main(IterateConfig(keep_previous=1.0, output_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="unknown key 'learning_rat'"):
        iterate.main(IterateConfig(sft={"learning_rat": 1.0}, output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="exactly one of --reasoner_base_url"):
        iterate.main(IterateConfig(distill={"reasoner_serve": False}, output_dir=str(tmp_path)))
    assert not (tmp_path / "eval-base").exists()


def test_recipes_parse():
    tiny = parse_config(IterateConfig, ["--config", iterate.TINY_CYCLES_RECIPE])
    assert tiny.num_cycles == 2 and tiny.output_dir == "outputs/tiny-cycles" and tiny.base_model == "tiny-base"
    published = parse_config(IterateConfig, ["--config", os.path.join(REPO, "recipes", "openvlthinker_cycles.yaml")])
    assert published.sft_sizes == [25000, 5000, 5000] and published.keep_previous == 0.7
    assert published.distill["num_chains"] == 4 and published.distill["select"] == "shortest"
    assert published.distill["max_words"] == 500
    assert published.grpo_medium["reward_funcs"] == ["math_accuracy"]
    import train_grpo

    for stage in ("medium", "hard"):
        values = stage_recipe(getattr(published, f"grpo_{stage}_recipe"), getattr(published, f"grpo_{stage}"), {})
        cfg = train_grpo.GRPOConfig(**values)
        assert (cfg.num_generations, cfg.temperature, cfg.beta, cfg.learning_rate) == (5, 1.0, 0.01, 1e-6)
        assert (cfg.max_pixels, cfg.max_completion_length) == (262144, 2048)
        assert cfg.freeze_vision_tower is (stage == "medium")


def test_report_numbers_and_claims(tmp_path):
    def write_eval(folder, accuracy, texts):
        os.makedirs(folder, exist_ok=True)
        metrics = {"samples": len(texts), "accuracy": accuracy, "format": 1.0,
                   "keywords": {"visual": {"per_response": 1.0, "response_rate": 1.0, "words": {}}}}
        (folder / "metrics.json").write_text(json.dumps(metrics))
        (folder / "generations.jsonl").write_text("".join(json.dumps({"completion": t}) + "\n" for t in texts))
        return str(folder)

    base = write_eval(tmp_path / "eval-base", 0.1, ["a red circle.", "a blue square."])
    cycles = []
    for i, (sft, medium, hard) in enumerate([(0.3, 0.4, 0.5), (0.35, 0.45, 0.6)], start=1):
        evals = {name: write_eval(tmp_path / f"c{i}-{name}", acc, ["I see two. Let me check: two."] * 2)
                 for name, acc in (("sft", sft), ("grpo-medium", medium), ("grpo-hard", hard))}
        cycles.append({"cycle": i, "data": {}, "evals": evals, "seconds": 1.0})
    report = iterate.write_report(IterateConfig(output_dir=str(tmp_path)), base, cycles)
    assert report["claims"] == {"each_sft_above_base": True, "last_rl_above_first_rl": True,
                                "rl_above_previous_cycle_rl": [True]}
    assert [v for _, v in report["accuracy_after_each_stage"]] == [0.1, 0.3, 0.4, 0.5, 0.35, 0.45, 0.6]
    # the base never says "see" or "check", the SFT model does: the score hits its cap of 2
    assert report["cycles"][0]["sft_efficacy"] == 2.0
    assert (tmp_path / "report.png").stat().st_size > 1000
    assert json.loads((tmp_path / "report.json").read_text())["claims"] == report["claims"]
    # one cycle: the cross-cycle claims exist only when there is a previous cycle to compare with
    os.makedirs(tmp_path / "one")
    alone = iterate.write_report(IterateConfig(output_dir=str(tmp_path / "one")), base, cycles[:1])
    assert alone["claims"] == {"each_sft_above_base": True}


def test_estimated_difficulty_becomes_a_column_for_the_hard_stage(tmp_path):
    import datasets

    rl = tmp_path / "rl-data"
    datasets.Dataset.from_dict({"id": ["a", "b", "c"], "question": ["q"] * 3, "answer": ["1"] * 3}).save_to_disk(rl)
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"difficulty_levels": ["easy", "hard", "medium"]}))
    out = iterate.write_estimated_difficulty(str(rl), str(checkpoint), str(tmp_path / "hard-data"))
    assert datasets.load_from_disk(out)[iterate.ESTIMATED_DIFFICULTY] == ["easy", "hard", "medium"]
    (checkpoint / "trainer_state.json").write_text(json.dumps({"difficulty_levels": ["easy"]}))
    with pytest.raises(SystemExit, match="no difficulty estimate for the 3 RL rows"):
        iterate.write_estimated_difficulty(str(rl), str(checkpoint), str(tmp_path / "other"))


def _micro_recipe(distill_world, tmp_path):
    from tiny.models import make_tiny_vlm

    questions, rows, reasoner = distill_world
    grpo = dict(prompt_template="think_answer", reward_funcs=["think_format", "math_accuracy"],
                reward_weights=[0.5, 1.0], difficulty_samples=0, num_generations=2, per_device_train_batch_size=4,
                max_prompt_length=256, max_completion_length=8, max_steps=2, save_steps=1, learning_rate=1e-3,
                report_to="none", logging_steps=1, cpu_threads=1)
    return dict(
        num_cycles=2, base_model=make_tiny_vlm(str(tmp_path / "base")), output_dir=str(tmp_path / "run"),
        sft_sizes=[6], keep_previous=0.5, next_data="model", rl_dataset=questions, rl_samples=9,
        eval_dataset=questions, eval_split="train", eval_samples=6,
        distill_recipe=None, distill=dict(dataset=questions, caption_column="caption", captioner=None,
                                          reasoner_serve=True, reasoner_model=reasoner, num_chains=2,
                                          temperature=0.0, max_new_tokens=64, max_concurrency=2, batch_size=8),
        sft_recipe=None, sft=dict(max_steps=4, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                                  report_to="none", logging_steps=1, max_length=256, cpu_threads=1),
        grpo_medium_recipe=None, grpo_medium=grpo, grpo_hard_recipe=None, grpo_hard=grpo,
        evaluate=dict(metrics=["accuracy", "keywords"], max_new_tokens=16, batch_size=8, cpu_threads=1))


def test_a_stage_flag_holding_a_secret_is_refused_before_its_recipe_is_written(tmp_path):
    import evaluate

    path = tmp_path / "eval-base" / "recipe.yaml"
    with pytest.raises(ConfigError, match=r"flag 'api_key' holds a secret in clear.*environment"):
        write_recipe({"api_key": "sk-live-0123456789", "model": "m"}, str(path), evaluate.EvalConfig)
    assert not path.exists() and not (tmp_path / "eval-base" / "recipe.yaml.tmp").exists()
