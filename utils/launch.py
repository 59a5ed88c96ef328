"""CPU launch fixes: start the N processes `accelerate launch --cpu --num_processes N` asked for, give
each process its share of the cores, and the Accelerator arguments that keep DeepSpeed on without a GPU.

For `--cpu`, accelerate's simple launcher starts one process and expects mpirun to fan it out; without
an MPI hostfile it silently runs a single process with world size 1. The launcher does leave its
traces (ACCELERATE_USE_CPU, MASTER_ADDR, no RANK), and its own command line names N, so a train
script can re-exec itself under torch.distributed.run with N workers that form a gloo group.
"""

import os
import sys


def _parent_num_processes():
    """N from the parent `accelerate launch ... --num_processes N` command line, or None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if not any(a.endswith("accelerate") for a in argv) or "launch" not in argv:
        return None
    for i, arg in enumerate(argv):
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith(("--num_processes=", "--num-processes=")):
            return int(arg.split("=", 1)[1])
    return None


def relaunch_multi_cpu_if_needed():
    """Re-exec under torch.distributed.run when accelerate asked for N > 1 CPU processes but started one."""
    env = os.environ
    launched_single = (env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_ADDR" in env
                       and "RANK" not in env and "PMI_SIZE" not in env and "OMPI_COMM_WORLD_SIZE" not in env)
    if not launched_single:
        return
    n = _parent_num_processes()
    if not n or n < 2:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
           f"--master_addr={env['MASTER_ADDR']}", f"--master_port={env.get('MASTER_PORT', '29500')}",
           sys.argv[0], *sys.argv[1:]]
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def accelerator_device_kwargs():
    """The device arguments of a train script's `Accelerator(...)`.

    With a GPU: none. Without one: `cpu=True`, because accelerate's torchrun launcher does not pass
    `use_cpu` on to the workers. Except under a DeepSpeed config (`ACCELERATE_USE_DEEPSPEED=true`, which needs
    `DS_ACCELERATOR=cpu` on a CPU machine): `cpu=True` would switch DeepSpeed off (accelerate's state.py
    enables it only `if not cpu`), and with `cpu=False` and no backend named, `PartialState` finds no GPU
    backend and takes its "no backend, no distributed training" branch (1 process, rank 0) even though
    DeepSpeed has just formed its gloo group of N. Naming gloo (`InitProcessGroupKwargs(backend="gloo")`)
    makes the state count the group's processes.
    """
    import torch

    if torch.cuda.is_available():
        return {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return {"cpu": True}
    if os.environ.get("DS_ACCELERATOR", "").lower() != "cpu":
        from utils.config import ConfigError

        raise ConfigError("a DeepSpeed accelerate config without a GPU needs DS_ACCELERATOR=cpu in the environment "
                          "(DeepSpeed picks its device at import), or a non-DeepSpeed config such as "
                          "accelerate_configs/cpu.yaml")
    from accelerate.utils import InitProcessGroupKwargs

    return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


def set_cpu_threads(requested=None):
    """Give torch this process's share of the cores when it runs on the CPU; returns the thread count set.

    `accelerate launch` without `--cpu` exports OMP_NUM_THREADS=1 (it spreads cores only for `--cpu`
    runs), which leaves all but one core idle on a machine without a GPU. `requested` (a script's
    `--cpu_threads`) wins; otherwise the cores this process may run on are split evenly between the
    processes on this machine (LOCAL_WORLD_SIZE). On a GPU machine nothing is changed (returns None).
    """
    import torch

    if torch.cuda.is_available() and requested is None:
        return None
    if requested is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        requested = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if requested < 1:
        raise ValueError(f"--cpu_threads {requested}: must be at least 1")
    torch.set_num_threads(requested)
    return requested
