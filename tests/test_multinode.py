"""Two machines on loopback: `accelerate launch --num_machines 2 --machine_rank 0|1` forms one group of N processes
(plain `--cpu` runs and DeepSpeed's multinode ZeRO-3 config) and trains exactly as one machine with N processes."""

import os
import signal
import socket
import subprocess
import sys

import pytest

import utils.core.launch as launch_utils
from tests.grpo_helpers import shapes_assets
from utils.core.config import ConfigError
from utils.core.tracking import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
KEYS = ("reward", "reward_std", "loss", "completion_length", "grad_norm")


def _relaunch_command(monkeypatch, parent):
    """The command relaunch_multi_cpu_if_needed execs for the parent launch (num_processes, machines, rank)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29611")
    for name in ("RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_utils, "_parent_launch", lambda: parent)
    seen = []
    monkeypatch.setattr(launch_utils.os, "execv", lambda exe, cmd: seen.append(cmd))
    launch_utils.relaunch_multi_cpu_if_needed()
    return seen[0] if seen else None


def test_two_machines_relaunch_as_two_nodes_of_one_group(monkeypatch):
    cmd = _relaunch_command(monkeypatch, (4, 2, 1))
    assert cmd[cmd.index("torch.distributed.run") + 1:][:6] == [
        "--nnodes=2", "--node_rank=1", "--nproc_per_node=2", "--rdzv_backend=static", "--master_addr=10.0.0.1",
        "--master_port=29611"]
    one = _relaunch_command(monkeypatch, (2, 1, 0))
    assert "--nnodes=1" in one and "--nproc_per_node=2" in one
    assert _relaunch_command(monkeypatch, (1, 1, 0)) is None  # one process: nothing to fan out


def test_uneven_or_out_of_range_machines_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="--num_machines 2 --num_processes 3"):
        _relaunch_command(monkeypatch, (3, 2, 0))
    with pytest.raises(ConfigError, match="--machine_rank 2: must be in 0..1"):
        _relaunch_command(monkeypatch, (2, 2, 2))


def test_parent_launch_reads_the_command_line_over_its_config(monkeypatch, tmp_path):
    """The values come from the parent's `accelerate launch` argv, the config file filling what it leaves out."""
    config = os.path.join(REPO, "accelerate_configs", "multinode_zero3.yaml")
    argv = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file", config, "--machine_rank", "1",
            "--num_processes", "2", "train_grpo.py", "--num_processes", "9"]
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(cmdline if str(p).startswith("/proc/") else p,
                                                                      *a, **k))
    assert launch_utils._parent_launch() == (2, 2, 1)  # num_machines 2 from the config; script args ignored


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_multinode.py", 16)


def _cli(assets, out, **overrides):
    cfg = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
               per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2,
               learning_rate=1e-3, report_to="none", reward_funcs="tests.grpo_helpers:completion_length", seed=0,
               save_steps=100)
    cfg.update(overrides)
    return [x for k, v in cfg.items() for x in (f"--{k}", str(v))]


def _start(launch_args, script_args, env=None):
    cmd = [ACCELERATE, "launch", *launch_args, "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(REPO, "train_grpo.py"), *script_args]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(*procs, timeout=600):
    """Wait for every launcher; on a hang (a rendezvous nobody joins) kill their process groups and fail."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"a launch ran over {timeout} s")
    for p, out in zip(procs, outs):
        assert p.returncode == 0, "\n".join(line for line in out.splitlines() if "rror" in line)[-3000:]


def _two_machines(launch_args, script_args, env=None):
    port = str(_free_port())
    _finish(*[_start([*launch_args, "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip",
                      "127.0.0.1", "--main_process_port", port], script_args, env) for rank in (0, 1)])


def _assert_same_steps(one, two):
    m1, m2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2]  # one writer: no step twice
    for a, b in zip(m1, m2):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key, a[key], b[key])
    assert m2[-1]["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.full
def test_two_cpu_machines_train_as_one_machine(assets, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _finish(_start(["--cpu", "--num_processes", "2", "--num_machines", "1"], _cli(assets, one)))
    # output_dir is shared, as on a cluster file system
    _two_machines(["--cpu", "--num_processes", "2"], _cli(assets, two))
    _assert_same_steps(one, two)


@pytest.mark.slow
@pytest.mark.full
def test_multinode_zero3_config_on_two_machines_matches_one_machine(assets, tmp_path):
    env = {"DS_ACCELERATOR": "cpu"}
    one, two = tmp_path / "one", tmp_path / "two"
    _finish(_start(["--config_file", os.path.join(REPO, "accelerate_configs", "zero3.yaml"), "--num_processes", "2"],
                   _cli(assets, one), env))
    _two_machines(["--config_file", os.path.join(REPO, "accelerate_configs", "multinode_zero3.yaml"),
                   "--num_processes", "2"], _cli(assets, two, save_steps=2), env)
    _assert_same_steps(one, two)
    shards = os.listdir(two / "checkpoint-2" / "training_state" / "pytorch_model")
    assert sorted(s for s in shards if "optim_states" in s) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], shards  # one ZeRO-3 group of 2 ranks
