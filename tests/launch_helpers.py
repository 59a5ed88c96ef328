"""Launching the project's scripts in tests: `accelerate launch` (1 or 2 CPU processes, or an accelerate_configs/
YAML), a plain `python script.py`, the flag list of a config, waiting for a run to finish, and SIGKILLing one at a
checkpoint. Every launch gets its own session, so a SIGKILL reaches the launcher and every worker it started."""

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ACCELERATE = os.path.join(BIN, "accelerate")


# DeepSpeed's CPU accelerator JIT-builds its shared-memory op into TORCH_EXTENSIONS_DIR, and the build files name
# the venv's paths: two venvs sharing the default folder (a CI copy and a checkout) rebuild it in turn, minutes
# each. One folder per venv.
EXTENSIONS = os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions",
                          "venv-" + hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])


def _popen(cmd, env=None):
    base = {"OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", EXTENSIONS)}
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **base, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def launch(script, args, num_processes=1, config=None, env=None):
    """`accelerate launch <script> <args>` in fp32 on `num_processes` CPU processes; with `config`, under
    accelerate_configs/<config>.yaml instead of --cpu (DeepSpeed's configs want DS_ACCELERATOR=cpu in `env`)."""
    if config is None:
        how = ["--cpu", "--num_processes", str(num_processes), "--num_machines", "1", "--dynamo_backend", "no"]
    else:
        how = ["--config_file", os.path.join(REPO, "accelerate_configs", f"{config}.yaml"),
               "--num_processes", str(num_processes)]
    if num_processes > 1:  # a free rendezvous port: two test sessions on one machine must not share 29500
        how += ["--main_process_port", str(free_port())]
    return _popen([ACCELERATE, "launch", *how, "--mixed_precision", "no", os.path.join(REPO, script), *args], env)


def launch_fsdp2(script, args, num_processes=2, env=None):
    """`script` under accelerate_configs/fsdp2.yaml on CPU processes, through tests/fsdp_worker.py (accelerate turns
    FSDP on only for GPU process groups; the worker lifts that gate and nothing else)."""
    return launch(os.path.join("tests", "fsdp_worker.py"), [script, *args], num_processes, config="fsdp2", env=env)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_python(script, args, env=None):
    """`python <script> <args>` (iterate.py, distill.py: they start their own stage launchers)."""
    return _popen([sys.executable, os.path.join(REPO, script), *args], env)


def cli(**flags):
    """The command line of these flags: --name value, in order."""
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def finish(proc, timeout=900, what=""):
    """Wait for a launched run; on a non-zero exit fail with the tail of its output (errors first)."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        errors = "\n".join(line for line in out.splitlines() if "rror" in line)[-2000:]
        raise AssertionError(f"{what or ' '.join(proc.args[:6])} exited with {proc.returncode}:\n{errors}\n"
                             f"--- last output ---\n{out[-3000:]}")
    return out


def sigkill_when(proc, ready, timeout=600, poll=0.05, whole_session=True):
    """SIGKILL the launched run (its whole session; with `whole_session=False` the launched process alone, as
    `kill -9 <pid>` does) as soon as `ready` holds: a path that exists, or a function that returns True. Fails if
    the run ended first."""
    done = ready if callable(ready) else lambda: os.path.exists(ready)
    deadline = time.time() + timeout
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {ready}:\n"
                                 f"{proc.stdout.read()[-3000:]}")
        assert time.time() < deadline, f"{ready} did not happen within {timeout} s"
        time.sleep(poll)
    if whole_session:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: the run really stops here
    else:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    time.sleep(1.0)  # nothing may still be writing into the folder


def fresh_accelerate_state():
    """Forget the accelerate state a script's main() made in this process, so the next in-process run starts
    as a launched one would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def failing_fixture(what):
    """Context manager for a session/module fixture's build: an error inside names `what` (e.g. 'the tiny Qwen VLM
    of tests/test_train_grpo.py'), so `pytest -x` says which shared asset failed, not only the first test."""
    return _Named(what)


class _Named:
    def __init__(self, what):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is not None and not isinstance(error, KeyboardInterrupt):
            raise RuntimeError(f"building {self.what} failed: {type(error).__name__}: {error}") from error
        return False
