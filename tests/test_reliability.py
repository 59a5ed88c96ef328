"""A run a user can trust with a week of GPUs (docs/reliability.md): no code from a checkpoint, no two runs in one
folder, no secret on disk, no non-finite step kept, no orphan stage. In this process, on tiny models; the launched
engines (DDP, ZeRO-2, ZeRO-3) are in tests/test_reliability_launch.py."""

import json
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

import train_grpo
from tests.grpo_helpers import shapes_assets
from tests.launch_helpers import REPO, failing_fixture, fresh_accelerate_state
from train_grpo import GRPOConfig
from utils.core.checkpoint import NonFiniteWeightsError, load_checkpoint, save_checkpoint
from utils.core.checkpoint_files import UnsafeCheckpointError, pickled_files
from utils.core.config import ConfigError, config_to_dict, parse_config, save_config
from utils.core.guards import NonFiniteStepsError, StepGuard, UnscoredError, UnscoredStreak
from utils.core.output_dir import FolderBusy, hold_lock, release
from utils.core.secrets import literal_secrets, redact, redact_url
from utils.core.tracking import read_jsonl

SECRET = "sk-live-0123456789abcdef"


class Boom:
    """Unpickling this creates `marker`: what a checkpoint from elsewhere could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').write('pwned')",)


# ---- secrets ----------------------------------------------------------------------------------------------------


def test_secret_names_urls_and_placeholders():
    config = {"api_key": SECRET, "max_new_tokens": 7, "metadata_keys": ["tag"], "max_output_token_n_gen": 196,
              "reward_kwargs": {"judge": {"Authorization": f"Bearer {SECRET}", "hub_token": SECRET, "timeout": 5}},
              "reward_server_urls": f"https://user:{SECRET}@judge.internal/v1?token={SECRET}&x=1", "empty": "EMPTY"}
    clean = redact(config)
    assert SECRET not in json.dumps(clean)
    assert clean["api_key"] == "<API_KEY>" and clean["reward_kwargs"]["judge"]["hub_token"] == "<HUB_TOKEN>"
    assert clean["reward_server_urls"] == "https://<CREDENTIALS>@judge.internal/v1?token=<TOKEN>&x=1"
    # counts and lists whose names hold 'tokens' / 'keys' are not secrets
    assert clean["max_new_tokens"] == 7 and clean["metadata_keys"] == ["tag"] and clean["max_output_token_n_gen"] == 196
    assert sorted(literal_secrets(config)) == ["api_key", "reward_kwargs.judge.Authorization",
                                               "reward_kwargs.judge.hub_token", "reward_server_urls"]
    assert literal_secrets(clean) == [] and literal_secrets({"api_key": "EMPTY", "token": None}) == []
    # a reward's selector and a tokenizer's tokens are not secrets (shapes_t2i's key="score" reads back as it was)
    selectors = {"reward_kwargs": {"key": "score", "pad_token": "<pad>", "image_token_id": 5, "access_key": "AKIA1"}}
    assert redact(selectors)["reward_kwargs"] == {"key": "score", "pad_token": "<pad>", "image_token_id": 5,
                                                  "access_key": "<ACCESS_KEY>"}
    from rewards import get_reward

    assert SECRET not in repr(get_reward("tests.grpo_helpers:always_one", api_key=SECRET))  # a repr reaches logs
    assert redact_url(f"judge http://me:{SECRET}@10.0.0.3:8000/v1 failed") == \
        "judge http://<CREDENTIALS>@10.0.0.3:8000/v1 failed"


def test_a_recipe_with_a_secret_is_refused_and_a_redacted_config_reads_back(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"reward_kwargs:\n  accuracy:\n    api_key: {SECRET}\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: key 'reward_kwargs.accuracy.api_key' holds a secret in "
                                          r"clear.*environment.*OPENAI_API_KEY"):
        parse_config(GRPOConfig, ["--config", str(recipe)])
    recipe.write_text("reward_server_urls: http://me:pw@127.0.0.1\n")
    with pytest.raises(ConfigError, match="reward_server_urls"):
        import train_mixgrpo

        parse_config(train_mixgrpo.MixGRPOConfig, ["--config", str(recipe)])
    # the command line may carry one (from the environment of the shell); what the run writes has it redacted, and
    # that config.yaml reads back with the secret unset, to come from the environment again
    cfg = parse_config(GRPOConfig, ["--reward_kwargs", json.dumps({"accuracy": {"api_key": SECRET}})])
    path = save_config(cfg, tmp_path / "config.yaml")
    assert SECRET not in path.read_text() and "<API_KEY>" in path.read_text()
    assert config_to_dict(cfg)["reward_kwargs"] == {"accuracy": {"api_key": "<API_KEY>"}}
    assert parse_config(GRPOConfig, ["--config", str(path)]).reward_kwargs == {"accuracy": {}}


# ---- GRPO runs in this process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_reliability.py", 24)


def grpo(assets, out, **overrides):
    values = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
                  per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_prompt_length=256,
                  max_steps=2, learning_rate=1e-3, report_to="none", save_steps=2, logging_steps=1, seed=0,
                  eval_dataset_name=None, reward_funcs=["tests.grpo_helpers:completion_length"])
    values.update(overrides)
    try:
        return train_grpo.main(GRPOConfig(**values))
    finally:
        fresh_accelerate_state()


@pytest.mark.slow
def test_a_secret_in_reward_kwargs_reaches_no_file_of_the_run(assets, tmp_path):
    """config.yaml, metrics, TensorBoard's event file and hparams.yml, the summary, the checkpoints: none holds it."""
    grpo(assets, tmp_path, report_to="tensorboard", log_completions=True, reward_kwargs={
        "tests.grpo_helpers:completion_length": {"api_key": SECRET, "endpoint": f"https://u:{SECRET}@h/v1"}})
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.startswith("events.out.tfevents") for p in files) and (tmp_path / "config.yaml").is_file()
    assert any(p.name == "hparams.yml" for p in files), sorted(p.name for p in files)
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []
    assert "<API_KEY>" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_one_run_per_folder(assets, tmp_path):
    grpo(assets, tmp_path / "run")
    first = load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors"))
    # a fresh run into it: refused before anything loads, naming the folder and the two ways on
    with pytest.raises(ConfigError, match=rf"--output_dir {tmp_path / 'run'} holds another run \(checkpoint-2.*"
                                          r"--resume_from_checkpoint latest.*--overwrite_output_dir"):
        grpo(assets, tmp_path / "run", model_name_or_path="not/loaded", learning_rate=5e-3)
    assert load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors")).keys() == first.keys()
    with pytest.raises(ConfigError, match="--overwrite_output_dir deletes the run.*drop one"):
        grpo(assets, tmp_path / "run", overwrite_output_dir=True, resume_from_checkpoint="latest")
    # a second process holding the folder: refused, naming its pid and host
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from utils.core.output_dir import hold_lock; "
                               "hold_lock(sys.argv[1]); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy, match=rf"in use by another run \(pid {holder.pid} on host "
                                             rf"{socket.gethostname()}\)"):
            grpo(assets, tmp_path / "run", resume_from_checkpoint="latest", max_steps=3)
    finally:
        holder.kill()
        holder.wait()
    # --overwrite_output_dir starts over: the old run's files are gone, the new run's written
    (tmp_path / "run" / "notes.txt").write_text("mine")
    grpo(assets, tmp_path / "run", overwrite_output_dir=True, max_steps=1, save_steps=1)
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # nothing but the run's own files is deleted
    # the lock was released when main returned: this process takes it again at once
    hold_lock(tmp_path / "run")
    release(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.full  # the fast tier plants pickles in-process (below) and under a ZeRO-3 launch
def test_a_pickle_planted_in_a_grpo_checkpoint_runs_no_code_on_resume(assets, tmp_path):
    grpo(assets, tmp_path)
    state = tmp_path / "checkpoint-2" / "training_state"
    clean = {p: p.read_bytes() for p in state.iterdir()}
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"):
        marker = tmp_path / f"pwned-{name}"
        torch.save({"state": Boom(marker)}, state / name)
        with pytest.raises(UnsafeCheckpointError, match=rf"training_state/{name}: "):
            grpo(assets, tmp_path, resume_from_checkpoint="latest", max_steps=3)
        assert not marker.exists()
        (state / name).write_bytes(clean[state / name])
    grpo(assets, tmp_path, resume_from_checkpoint="latest", max_steps=3, save_steps=3)  # the clean one resumes
    assert json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


@pytest.mark.slow
def test_a_reward_that_returns_inf_once_trains_on_finite_numbers(assets, tmp_path):
    grpo(assets, tmp_path, reward_funcs=["tests.grpo_helpers:inf_once"])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[0]["rewards/tests.grpo_helpers:inf_once/non_finite"] == 1  # counted, and left out
    assert metrics[0]["frac_unscorable"] == pytest.approx(1 / 8)
    assert all(torch.isfinite(torch.tensor([m["loss"], m["grad_norm"], m["reward"]])).all() for m in metrics)
    weights = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    assert all(t.isfinite().all() for t in weights.values())


# ---- checkpoints: what resume may load --------------------------------------------------------------------------


def _saved(tmp_path, manifest=True):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    accelerator.register_for_checkpointing(scheduler)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    path = save_checkpoint(accelerator, tmp_path, 1, model=model)
    if not manifest:
        os.remove(os.path.join(path, "training_state", "manifest.json"))
    return accelerator, path


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_every_pickled_file_of_training_state_is_checked_before_anything_loads(tmp_path, manifest):
    accelerator, path = _saved(tmp_path, manifest)
    state = os.path.join(path, "training_state")
    names = sorted(str(p.relative_to(state)) for p in pickled_files(state))
    assert names == ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"]
    for name in names + ["model.safetensors"]:
        file = os.path.join(state, name)
        clean = open(file, "rb").read()
        marker = tmp_path / f"pwned-{name}"
        for planted in ("torch", "raw"):  # torch.save's zip format, and a bare pickle
            if planted == "torch":
                torch.save({"state": Boom(marker)}, file)
            else:
                open(file, "wb").write(pickle.dumps(Boom(marker)))
            with pytest.raises(Exception, match=rf"{file}: ") as refusal:
                load_checkpoint(accelerator, path)
            assert not marker.exists(), (name, planted)
            assert name == "model.safetensors" or isinstance(refusal.value, UnsafeCheckpointError)
        open(file, "wb").write(clean)
    assert load_checkpoint(accelerator, path)["global_step"] == 1


def test_the_manifest_refuses_a_changed_added_or_missing_file(tmp_path):
    accelerator, path = _saved(tmp_path)
    state = os.path.join(path, "training_state")
    clean = open(os.path.join(state, "random_states_0.pkl"), "rb").read()
    torch.save({"step": 0}, os.path.join(state, "random_states_0.pkl"))  # harmless data, but not what was saved
    with pytest.raises(UnsafeCheckpointError, match=r"random_states_0.pkl: its sha256 differs"):
        load_checkpoint(accelerator, path)
    open(os.path.join(state, "random_states_0.pkl"), "wb").write(clean)
    torch.save({"x": torch.zeros(1)}, os.path.join(state, "custom_checkpoint_1.pkl"))
    with pytest.raises(UnsafeCheckpointError, match=r"custom_checkpoint_1.pkl: not in manifest.json"):
        load_checkpoint(accelerator, path)
    os.remove(os.path.join(state, "custom_checkpoint_1.pkl"))
    os.remove(os.path.join(state, "optimizer.bin"))
    with pytest.raises(UnsafeCheckpointError, match=r"optimizer.bin: listed in manifest.json but missing"):
        load_checkpoint(accelerator, path)


def test_a_checkpoint_is_flushed_to_disk_before_its_rename(tmp_path, monkeypatch):
    synced, renamed = set(), {}
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        renamed[str(dst)] = set(synced)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _, path = _saved(tmp_path)
    before = renamed[path]
    tmp = str(tmp_path / ".tmp-checkpoint-1")
    files = [os.path.join(tmp, str(p.relative_to(path))) for p in __import__("pathlib").Path(path).rglob("*")
             if p.is_file()]
    assert files and all(f in before for f in files), sorted(set(files) - before)
    assert tmp in before and os.path.join(tmp, "training_state") in before  # the folders too
    assert str(tmp_path) in synced  # and the rename itself


def test_no_checkpoint_from_non_finite_weights(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    save_checkpoint(accelerator, tmp_path, 1, model=model)
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"step 2: weight 'weight' is not finite.*no checkpoint"):
        save_checkpoint(accelerator, tmp_path, 2, model=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


# ---- guards -----------------------------------------------------------------------------------------------------


def test_the_step_guard_skips_non_finite_steps_and_stops_after_max_in_a_row():
    accelerator = Accelerator(cpu=True)
    guard = StepGuard(accelerator, max_skipped_steps=2)
    layer = torch.nn.Linear(2, 1)
    layer(torch.ones(1, 2)).sum().backward()
    assert guard.step_ok(1, torch.tensor(0.5), grad_norm=torch.tensor(3.0))
    assert not guard.step_ok(2, torch.tensor(float("nan")), grad_norm=torch.tensor(3.0))
    assert guard.step_ok(3, torch.tensor(0.5), parameters=layer.parameters())  # a good step resets the run of skips
    layer.weight.grad[0, 0] = float("inf")
    assert not guard.step_ok(4, torch.tensor(0.5), parameters=layer.parameters())  # no norm: the gradients checked
    assert guard.state_dict() == {"skipped_steps": 2, "in_a_row": 1}
    with pytest.raises(NonFiniteStepsError, match=r"step 5: 2 optimizer steps in a row .*--max_skipped_steps 2"):
        guard.step_ok(5, torch.tensor(0.5), grad_norm=torch.tensor(float("inf")))
    resumed = StepGuard(accelerator, 2)
    resumed.load_state_dict({"skipped_steps": 4, "in_a_row": 1})
    with pytest.raises(NonFiniteStepsError):
        resumed.step_ok(9, float("inf"))


def test_a_reward_that_scores_nothing_stops_the_run_naming_it():
    streak = UnscoredStreak("judge_tiif", max_unscored_steps=2)
    streak.update("reason", 0, asked=8, scored=0)
    streak.update("reflect", 1, asked=8, scored=0)  # counted per stage
    streak.update("reflect", 3, asked=0, scored=0)  # nothing asked: no verdict either way
    streak.update("reason", 2, asked=8, scored=1)  # one score resets
    streak.update("reason", 4, asked=8, scored=0)
    with pytest.raises(UnscoredError, match=r"step 5: reward 'judge_tiif' scored none of the reflect stage's images "
                                            r"for 2 of its steps in a row \(--max_unscored_steps 2\)"):
        streak.update("reflect", 5, asked=8, scored=0)


# ---- smaller ones -----------------------------------------------------------------------------------------------


def test_ddp_timeout_reaches_the_process_group_and_bad_run_flags_are_refused(tmp_path):
    from datetime import timedelta

    from utils.core.launch import accelerator_device_kwargs
    from utils.core.run import make_accelerator

    (handler,) = accelerator_device_kwargs(ddp_timeout=77)["kwargs_handlers"]
    assert handler.to_kwargs() == {"timeout": timedelta(seconds=77)}
    cfg = GRPOConfig(output_dir=str(tmp_path / "a"), ddp_timeout=77, report_to="none")
    try:
        assert make_accelerator(cfg).init_handler.timeout == timedelta(seconds=77)
    finally:
        release(cfg.output_dir)
        fresh_accelerate_state()
    for flags, message in ((dict(ddp_timeout=0), "--ddp_timeout 0 must be >= 1"),
                           (dict(max_skipped_steps=0), "--max_skipped_steps 0"),
                           (dict(hub_private_repo=True), "--hub_private_repo .* give --push_to_hub")):
        with pytest.raises(ConfigError, match=message):
            make_accelerator(GRPOConfig(output_dir=str(tmp_path / "b"), report_to="none", **flags))
    assert not (tmp_path / "b").exists()


def test_hub_pushes_stage_inside_the_output_folder_into_a_private_repo(tmp_path, monkeypatch):
    import utils.core.hub as hub
    from tests.test_tracking_hub import FakeApi, make_checkpoint

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    checkpoint = make_checkpoint(tmp_path / "out" / "checkpoint-3")
    uploader = hub.HubUploader("me/run", private=True, staging_root=str(tmp_path / "out"))
    api = FakeApi.instances[-1]
    staged = []
    real = hub.stage_for_hub
    monkeypatch.setattr(hub, "stage_for_hub", lambda c, s, **kw: staged.append(str(s)) or real(c, s, **kw))
    uploader.push(checkpoint, recipe={"api_key": SECRET}, metrics={}, base_model="b", script="train_grpo.py")
    api.release.set()
    uploader.wait()
    assert staged[0].startswith(str(tmp_path / "out" / ".hub-staging") + os.sep)
    assert api.calls[0] == ("create_repo", "me/run", True, True)
    assert GRPOConfig(hub_private_repo=True).hub_private_repo  # the flag that sets it


def test_evaluate_writes_outside_the_models_folder_by_default(tmp_path):
    import evaluate

    model = tmp_path / "run" / "checkpoint-400"
    model.mkdir(parents=True)
    out = evaluate.default_output_dir(evaluate.EvalConfig(model=str(model)))
    assert out == os.path.join("outputs", "eval", "run-checkpoint-400")
    assert evaluate.default_output_dir(evaluate.EvalConfig(model="Qwen/Qwen2.5-VL-3B-Instruct")) == \
        os.path.join("outputs", "eval", "Qwen--Qwen2.5-VL-3B-Instruct")
    served = evaluate.EvalConfig(base_url="http://127.0.0.1:8000/v1", served_model_name="my/model")
    assert evaluate.default_output_dir(served) == os.path.join("outputs", "eval", "my--model")


WATCHED = """
import subprocess, sys, time
sys.path.insert(0, {repo!r})
from utils.core.launch import watch_stage_parent
watch_stage_parent(poll=0.1)
if sys.argv[1] == "launcher":  # a launcher that starts its worker in a session of its own, as torchrun does
    subprocess.Popen([sys.executable, __file__, "worker"], start_new_session=True)
time.sleep(120)
"""


def test_a_stage_ends_with_the_iterate_process_that_started_it(tmp_path):
    """SIGKILL iterate.py's stand-in alone: the stage's launcher and its worker (in a session of its own) end within
    seconds (utils.core.launch.watch_stage_parent)."""
    script = tmp_path / "stage.py"
    script.write_text(WATCHED.format(repo=REPO))
    runner = (f"import os, subprocess, sys, time; sys.path.insert(0, {REPO!r}); "
              "from utils.core.launch import stage_parent_env; "
              f"subprocess.Popen([sys.executable, {str(script)!r}, 'launcher'], "
              "env={**os.environ, **stage_parent_env()}, start_new_session=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", runner], start_new_session=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(stage_processes_of(parent.pid)) < 2:
            time.sleep(0.1)
        stage = stage_processes_of(parent.pid)
        assert len(stage) == 2, stage
    finally:
        parent.kill()  # iterate.py alone, SIGKILL: it runs no clean-up of its own
        parent.wait()
    deadline = time.time() + 5
    while time.time() < deadline and [p for p in stage if _alive(p)]:
        time.sleep(0.1)
    assert not [p for p in stage if _alive(p)]


def stage_processes_of(pid):
    """The stage processes of the runner `pid`, by the variable it gave them."""
    from utils.core.launch import _start_time, stage_processes

    return stage_processes(f"{pid}:{_start_time(pid)}")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# ---- the step guard in each training script --------------------------------------------------------------------

NAN_STEPS = (2, 4, 5)  # skipped: step 2 alone, then steps 4 and 5 in a row, the second skip in a row stops the run


def nan_on(steps, fn, pick=lambda out: out):
    """`fn` with its loss turned NaN on the calls numbered `steps` (one call per optimizer step)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        out = fn(*args, **kwargs)
        if len(calls) in steps:
            loss, rest = pick(out)
            return (loss * float("nan"),) + rest if rest is not None else loss * float("nan")
        return out

    return wrapped


def assert_guarded(out, model_file="model.safetensors"):
    """Steps 1-4 logged with skipped_steps 0, 1, 1, 2; a skipped step's checkpoint holds the weights before it; no
    checkpoint of step 5; every weight finite."""
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "skipped_steps" in m]
    assert [(m["step"], m["skipped_steps"]) for m in metrics] == [(1, 0), (2, 1), (3, 1), (4, 2)]
    weights = {s: load_file(str(out / f"checkpoint-{s}" / model_file)) for s in (1, 2, 3, 4)}
    same = {s: all(weights[s][k].equal(weights[s - 1][k]) for k in weights[s]) for s in (2, 3, 4)}
    assert same == {2: True, 3: False, 4: True}, same
    assert all(t.isfinite().all() for w in weights.values() for t in w.values())
    assert not (out / "checkpoint-5").exists()


@pytest.mark.slow
def test_grpo_skips_a_non_finite_step_and_stops_after_max_skipped_steps(assets, tmp_path, monkeypatch):
    monkeypatch.setattr(train_grpo, "clipped_policy_loss", nan_on(NAN_STEPS, train_grpo.clipped_policy_loss,
                                                                  lambda out: (out[0], out[1:])))
    with pytest.raises(NonFiniteStepsError, match=r"step 5: 2 optimizer steps in a row had a NaN or infinite loss"):
        grpo(assets, tmp_path, max_steps=6, save_steps=1, max_skipped_steps=2)
    assert_guarded(tmp_path)
    guard = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["guard"]
    assert guard == {"skipped_steps": 2, "in_a_row": 1}  # a resumed run counts on


@pytest.mark.slow
@pytest.mark.full  # the same StepGuard as GRPO's (fast tier)
def test_sft_skips_a_non_finite_step_and_stops_after_max_skipped_steps(assets, tmp_path, monkeypatch):
    import train_sft

    monkeypatch.setattr(train_sft.AssistantNLL, "forward",
                        nan_on(NAN_STEPS, train_sft.AssistantNLL.forward, lambda out: (out, None)))
    cfg = train_sft.SFTConfig(model_name_or_path=assets["qwen"], dataset_name=assets["data"],
                              output_dir=str(tmp_path), max_steps=6, save_steps=1, per_device_train_batch_size=4,
                              max_length=256, learning_rate=1e-3, report_to="none", max_skipped_steps=2)
    try:
        with pytest.raises(NonFiniteStepsError, match=r"step 5: 2 optimizer steps in a row"):
            train_sft.main(cfg)
    finally:
        fresh_accelerate_state()
    assert_guarded(tmp_path)


@pytest.fixture(scope="module")
def t2i_generator(tmp_path_factory):
    from tiny.pipelines import make_tiny_qwenimage

    with failing_fixture("tests/test_reliability.py's tiny Qwen-Image pipeline"):
        return make_tiny_qwenimage(str(tmp_path_factory.mktemp("reliability-t2i") / "qwenimage"))


def mixgrpo(generator, out, **overrides):
    import train_mixgrpo
    from tests.test_mixgrpo import TINY_CFG

    cfg = train_mixgrpo.MixGRPOConfig(**{**TINY_CFG, **dict(
        model_name_or_path=os.path.join(generator, "_vlm"), generator_name_or_path=generator, output_dir=str(out),
        max_steps=6, save_steps=1, learning_rate=1e-3, warmup_steps=0, val_data_path=None, cpu_threads=1),
        **overrides})
    try:
        return train_mixgrpo.main(cfg)
    finally:
        fresh_accelerate_state()


@pytest.mark.slow
@pytest.mark.full
def test_mixgrpo_skips_a_non_finite_step_and_stops_after_max_skipped_steps(t2i_generator, tmp_path, monkeypatch):
    import train_mixgrpo

    monkeypatch.setattr(train_mixgrpo, "mixgrpo_loss", nan_on(NAN_STEPS, train_mixgrpo.mixgrpo_loss,
                                                              lambda out: (out[0], out[1:])))
    with pytest.raises(NonFiniteStepsError, match=r"step 5: 2 optimizer steps in a row"):
        mixgrpo(t2i_generator, tmp_path, max_skipped_steps=2)
    # the image part trains on every step (the tiny VLM's text earns no reward to move it)
    assert_guarded(tmp_path, os.path.join("generator_lora", "pytorch_lora_weights.safetensors"))


@pytest.mark.slow
@pytest.mark.full
def test_mixgrpo_stops_when_its_reward_scores_nothing_step_after_step(t2i_generator, tmp_path):
    with pytest.raises(UnscoredError, match=r"step 3: reward 'tests.mixgrpo_helpers:no_score' scored none of the "
                                            r"reason stage's images for 2 of its steps in a row"):
        mixgrpo(t2i_generator, tmp_path, reward_fn="tests.mixgrpo_helpers:no_score", max_unscored_steps=2)
    assert [m["reason/unscored"] for m in read_jsonl(tmp_path / "metrics.jsonl") if "reason/unscored" in m] == [1.0]


def test_fsdp_sharded_checkpoints_are_checked_too(tmp_path):
    """FSDP's SHARDED_STATE_DICT is torch.distributed.checkpoint's folder: `.metadata`, which DCP unpickles with
    pickle.load, passes only as DCP's own data classes; its `.distcp` shards DCP reads weights-only itself."""
    import torch.distributed.checkpoint as dcp

    from utils.core.checkpoint_files import verify_training_state

    state = tmp_path / "training_state"
    dcp.save({"model": {"w": torch.randn(3, 4)}, "optimizer": {"param_groups": [{"lr": 0.1, "params": [0]}]}},
             storage_writer=dcp.FileSystemWriter(str(state / "pytorch_model_fsdp_0")), no_dist=True)
    accelerator = Accelerator(cpu=True)
    verify_training_state(accelerator, state)  # DCP's own files pass
    marker = tmp_path / "pwned"
    (state / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Boom(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"pytorch_model_fsdp_0/.metadata: refused, it holds more than "
                                                    r"DCP's checkpoint metadata"):
        verify_training_state(accelerator, state)
    assert not marker.exists()
