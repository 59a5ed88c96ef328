"""utils/core/launch.py: each CPU process gets its share of the cores, whatever OMP_NUM_THREADS the launcher set."""

import os
import subprocess
import sys

import pytest
import torch

from utils.core.config import ConfigError
from utils.core.launch import set_cpu_threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)


def test_one_process_gets_every_core(restore_threads, four_cores, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    torch.set_num_threads(1)  # what `accelerate launch` without --cpu leaves behind
    assert set_cpu_threads() == 4
    assert torch.get_num_threads() == 4


def test_cores_are_shared_between_local_processes(restore_threads, four_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert set_cpu_threads() == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # more processes than cores: one thread each, never zero
    assert set_cpu_threads() == 1 and torch.get_num_threads() == 1


def test_requested_threads_win(restore_threads, four_cores, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert set_cpu_threads(3) == 3 and torch.get_num_threads() == 3
    with pytest.raises(ConfigError, match="--cpu_threads 0"):
        set_cpu_threads(0)


def test_gpu_machine_is_left_alone(restore_threads, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    torch.set_num_threads(1)
    assert set_cpu_threads() is None
    assert torch.get_num_threads() == 1


def test_overrides_omp_num_threads_one_in_a_fresh_process():
    """What `accelerate launch` (no --cpu) leaves behind, OMP_NUM_THREADS=1, does not cap the process."""
    code = ("import torch; from utils.core.launch import set_cpu_threads; before = torch.get_num_threads(); "
            "set_cpu_threads(2); print(before, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split()[-2:] == ["1", "2"]


def test_accelerator_keeps_deepspeed_on_without_a_gpu(monkeypatch):
    from utils.core.config import ConfigError
    from utils.core.launch import accelerator_device_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert accelerator_device_kwargs() == {"cpu": True}  # DDP over gloo, as the launcher does not pass use_cpu
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="DS_ACCELERATOR=cpu"):
        accelerator_device_kwargs()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    kwargs = accelerator_device_kwargs()
    assert kwargs["cpu"] is False  # cpu=True would switch DeepSpeed off
    (handler,) = kwargs["kwargs_handlers"]
    assert handler.backend == "gloo"  # without it accelerate counts 1 process in DeepSpeed's group of 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert accelerator_device_kwargs() == {}
