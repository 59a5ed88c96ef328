"""CPU launch fixes: start the N processes `accelerate launch --cpu --num_processes N` asked for, give
each process its share of the cores, and the Accelerator arguments that keep DeepSpeed on without a GPU.

For `--cpu`, accelerate's simple launcher starts one process and expects mpirun to fan it out; without
an MPI hostfile it silently runs a single process with world size 1. The launcher does leave its
traces (ACCELERATE_USE_CPU, MASTER_ADDR, no RANK), and its own command line names N, so a train
script can re-exec itself under torch.distributed.run with N workers that form a gloo group.
"""

import os
import sys

from utils.core.config import ConfigError


def _parent_launch():
    """(num_processes, num_machines, machine_rank) of the parent `accelerate launch` command, or None.

    The command line wins over its --config_file (or accelerate's default config, which accelerate itself
    reads only without --cpu); a value neither names is None.
    """
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if not any(a.endswith("accelerate") for a in argv) or "launch" not in argv:
        return None
    from accelerate.commands.config import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv[argv.index("launch") + 1:])
    values = {"num_processes": args.num_processes, "num_machines": args.num_machines,
              "machine_rank": args.machine_rank}
    if args.config_file is not None or (os.path.isfile(default_config_file) and not args.cpu):
        defaults = load_config_from_file(args.config_file)
        for name in values:
            if values[name] is None:
                values[name] = getattr(defaults, name, None)
    return values["num_processes"], values["num_machines"] or 1, values["machine_rank"] or 0


def relaunch_multi_cpu_if_needed():
    """Re-exec under torch.distributed.run when accelerate asked for N > 1 CPU processes but started one.

    On M > 1 machines (`--num_machines M --machine_rank R`, N processes in all) each machine starts N / M
    workers as node R of a static rendezvous at accelerate's main_process_ip:port, so the M machines form
    one group of N (not M separate groups that each train as if alone).
    """
    env = os.environ
    launched_single = (env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_ADDR" in env
                       and "RANK" not in env and "PMI_SIZE" not in env and "OMPI_COMM_WORLD_SIZE" not in env)
    if not launched_single:
        return
    parent = _parent_launch()
    if parent is None:
        return
    n, machines, machine_rank = parent
    if machines > 1:
        if not n or n % machines:
            raise ConfigError(f"accelerate launch --num_machines {machines} --num_processes {n}: the processes "
                              "must split evenly over the machines (--num_processes is the total)")
        if not 0 <= machine_rank < machines:
            raise ConfigError(f"accelerate launch --machine_rank {machine_rank}: must be in 0..{machines - 1}")
    elif not n or n < 2:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={machines}", f"--node_rank={machine_rank}",
           f"--nproc_per_node={n // machines}", "--rdzv_backend=static",
           f"--master_addr={env['MASTER_ADDR']}", f"--master_port={env.get('MASTER_PORT', '29500')}",
           sys.argv[0], *sys.argv[1:]]
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def accelerator_device_kwargs(ddp_timeout=None):
    """The device and process-group arguments of a train script's `Accelerator(...)`; `ddp_timeout` (seconds, HF's
    flag): how long a collective waits for the other processes before the run fails (None: torch's default).

    With a GPU: none. Without one: `cpu=True`, because accelerate's torchrun launcher does not pass
    `use_cpu` on to the workers. Except under a DeepSpeed config (`ACCELERATE_USE_DEEPSPEED=true`, which needs
    `DS_ACCELERATOR=cpu` on a CPU machine): `cpu=True` would switch DeepSpeed off (accelerate's state.py
    enables it only `if not cpu`), and with `cpu=False` and no backend named, `PartialState` finds no GPU
    backend and takes its "no backend, no distributed training" branch (1 process, rank 0) even though
    DeepSpeed has just formed its gloo group of N. Naming gloo (`InitProcessGroupKwargs(backend="gloo")`)
    makes the state count the group's processes.
    """
    from datetime import timedelta

    import torch
    from accelerate.utils import InitProcessGroupKwargs

    group = {} if ddp_timeout is None else {"timeout": timedelta(seconds=ddp_timeout)}
    if torch.cuda.is_available():
        return {"kwargs_handlers": [InitProcessGroupKwargs(**group)]} if group else {}
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return {"cpu": True, **({"kwargs_handlers": [InitProcessGroupKwargs(**group)]} if group else {})}
    if os.environ.get("DS_ACCELERATOR", "").lower() != "cpu":
        raise ConfigError("a DeepSpeed accelerate config without a GPU needs DS_ACCELERATOR=cpu in the environment "
                          "(DeepSpeed picks its device at import), or a non-DeepSpeed config such as "
                          "accelerate_configs/cpu.yaml")
    return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo", **group)]}


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
        raise ConfigError(f"--cpu_threads {requested}: must be at least 1")
    torch.set_num_threads(requested)
    return requested


# ---- stages of iterate.py: no process outlives the runner that started it ----

STAGE_PARENT_ENV = "MMGRPO_STAGE_PARENT"  # "<pid>:<start time>" of the iterate.py that started this stage


def _start_time(pid):
    """The kernel's start time of process `pid` (Linux), "" elsewhere, None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""


def stage_parent_env():
    """The environment entry iterate.py gives every stage: itself, as `watch_stage_parent` recognises it."""
    return {STAGE_PARENT_ENV: f"{os.getpid()}:{_start_time(os.getpid()) or ''}"}


def stage_processes(token):
    """Pids of every process of this user whose environment carries `STAGE_PARENT_ENV=token` (Linux)."""
    entry = f"{STAGE_PARENT_ENV}={token}".encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:  # gone, or another user's
                pass
    return found


def watch_stage_parent(poll=0.5):
    """In a script started as a stage of iterate.py (STAGE_PARENT_ENV set): a daemon thread that, within `poll`
    seconds of that iterate.py's end, however it ended (SIGKILL included), SIGKILLs every process of the stage: the
    launcher, torchrun's agent, each worker, servers they started (all carry the variable), then this one. A stage
    killed mid-run loses nothing a rerun needs: checkpoints are atomic and the rerun resumes from the last one.
    Elsewhere a no-op."""
    token = os.environ.get(STAGE_PARENT_ENV)
    if not token or ":" not in token:
        return None
    import signal
    import threading
    import time

    pid, start = token.split(":", 1)

    def parent_alive():
        now = _start_time(int(pid))
        return now is not None and (not start or not now or now == start)

    def watch():
        while parent_alive():
            time.sleep(poll)
        for other in stage_processes(token):
            if other != os.getpid():
                try:
                    os.kill(other, signal.SIGKILL)
                except OSError:
                    pass
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="stage-parent-watch", daemon=True)
    thread.start()
    return thread
