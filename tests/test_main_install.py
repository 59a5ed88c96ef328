"""The main command runs on the main install: `python iterate.py --help` answers, a run that needs `transformers
serve` without its packages is refused before any build with the one command that fixes it, and (full tier) an
environment that holds only requirements.txt's packages imports every script and starts `transformers serve`."""

import os
import subprocess
import sys
import time

import pytest

import distill
import iterate
import utils.core.serving
from iterate import IterateConfig
from utils.core.config import ConfigError, parse_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = "pip install -r requirements.txt"


def test_iterate_help_answers():
    out = subprocess.run([sys.executable, os.path.join(REPO, "iterate.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--next_data_serve" in out.stdout and "--restart_stage" in out.stdout and "--rl_eval_steps" in out.stdout


@pytest.fixture
def no_serving(monkeypatch):
    """`transformers serve`'s packages, as if one were not installed."""
    monkeypatch.setattr(utils.core.serving, "SERVING_PACKAGES",
                        utils.core.serving.SERVING_PACKAGES + ("no_such_package_x",))


def test_distill_refuses_a_served_model_without_the_serving_packages(no_serving):
    cfg = parse_config(distill.DistillConfig, ["--config", distill.TINY_DISTILL_RECIPE])
    assert cfg.reasoner_serve
    with pytest.raises(ConfigError, match=rf"--reasoner_serve needs `transformers serve`.*no_such_package_x.*{FIX}"):
        distill.validate(cfg)
    served_vlm = distill.DistillConfig(chain_source="model", model="some/checkpoint", model_serve=True)
    with pytest.raises(ConfigError, match=rf"--model_serve needs .*{FIX}"):
        distill.validate(served_vlm)
    distill.validate(distill.DistillConfig(chain_source="model", model="some/checkpoint"))  # in-process: no server


def test_iterate_refuses_before_any_build(no_serving, tmp_path, monkeypatch):
    import tiny.cache

    def no_build(*args, **kwargs):
        raise AssertionError("a tiny model or data set was built before the refusal")

    monkeypatch.setattr(tiny.cache, "resolve_tiny_name", no_build)
    monkeypatch.setattr(tiny.cache, "shapes_dataset_path", no_build)
    monkeypatch.setattr(iterate, "resolve_tiny_name", no_build)  # the names iterate.py calls them by
    monkeypatch.setattr(iterate, "resolve_dataset", no_build)
    cfg = parse_config(IterateConfig, ["--config", iterate.TINY_CYCLES_RECIPE, "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=rf"needs `transformers serve`.*{FIX}"):
        iterate.main(cfg)
    with pytest.raises(ConfigError, match=rf"iterate.py --next_data_serve needs .*{FIX}"):
        iterate.main(IterateConfig(next_data_serve=True, output_dir=str(tmp_path / "run2")))
    assert sorted(os.listdir(tmp_path / "run")) == [".lock", "config.yaml"]  # the lock: iterate.Runner.hold


@pytest.mark.slow
@pytest.mark.full
def test_an_environment_of_requirements_txt_alone_runs_the_scripts_and_serves(tmp_path):
    """A venv that sees only the closure of requirements.txt's pins (tests/requirements_env.py; ~5 s to link, no
    download): every script imports, `iterate.py --help` answers, a dev-only package does not import, and
    `transformers serve` answers on 127.0.0.1 with a tiny model."""
    from tests.requirements_env import closure, make_view_venv, pinned
    from tiny.models import make_tiny_llm

    python = make_view_venv(str(tmp_path / "venv"), closure(pinned()))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *args: subprocess.run([python, *args], cwd=REPO, env=env, capture_output=True, text=True,  # noqa: E731
                                       timeout=600)
    assert "No module named 'trl'" in run("-c", "import trl").stderr  # the view holds requirements.txt only
    scripts = "import iterate, distill, evaluate, train_sft, train_grpo, train_mixgrpo, rewards.judge"
    assert run("-c", scripts).returncode == 0, run("-c", scripts).stderr[-2000:]
    helped = run(os.path.join(REPO, "iterate.py"), "--help")
    assert helped.returncode == 0 and "--num_cycles" in helped.stdout, helped.stderr[-2000:]
    model = make_tiny_llm(str(tmp_path / "llm"))
    serve = ("import sys, requests; from utils.core.serving import LocalServer\n"
             "with LocalServer(sys.argv[1], device='cpu', threads=1) as s:\n"
             "    print(requests.get(s.base_url + '/models', timeout=30).json()['data'][0]['id'])")
    start = time.monotonic()
    served = run("-c", serve, model)
    assert served.returncode == 0 and served.stdout.strip() == model, served.stderr[-3000:]
    print(f"transformers serve from requirements.txt alone answered in {time.monotonic() - start:.0f} s")


def test_training_stages_launch_with_iterates_own_interpreter():
    """`accelerate launch` of the interpreter iterate.py runs in, not whichever `accelerate` is first on PATH (a
    stage would otherwise run in another environment than the one checked above)."""
    command = iterate.Runner(IterateConfig()).launch("train_sft.py", "recipe.yaml")
    assert command[:4] == [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    assert command[-3:] == [os.path.join(REPO, "train_sft.py"), "--config", "recipe.yaml"]
