"""A local OpenAI-compatible server for a model folder: `transformers serve` (transformers' own server) on
127.0.0.1, started for the length of a run. distill.py uses it to ask a reasoner or captioner that has no
server of its own (`--reasoner_serve`), the tiny cycle uses it for the tiny reasoner, the tests for every
server path. A vLLM server is the faster choice for big models; the client side is the same.

    with LocalServer("outputs/my-reasoner") as server:
        JudgeClient(server.base_url, server.model_name).chat("2 + 2?")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import requests


class ServerStartError(RuntimeError):
    """`transformers serve` exited or did not answer in time; the message holds the end of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent():
    """For `preexec_fn`: the child gets SIGKILL when the process that started it dies, however it dies (Linux;
    elsewhere a no-op), so a killed run leaves no server or stage behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic")  # what transformers' is_serve_available checks


def missing_serving_packages() -> list[str]:
    """The packages `transformers serve` needs that this environment lacks (none: it can serve)."""
    from importlib.util import find_spec

    return [name for name in SERVING_PACKAGES if find_spec(name) is None]


def serving_problem(what: str = "`transformers serve`"):
    """None when `transformers serve` can run here, else the one-line refusal with the command that fixes it."""
    missing = missing_serving_packages()
    if not missing:
        return None
    return (f"{what} needs `transformers serve`, whose packages {', '.join(missing)} are not installed here; "
            "install the pinned set: pip install -r requirements.txt")


def require_serving(what: str = "`transformers serve`"):
    problem = serving_problem(what)
    if problem:
        raise ServerStartError(problem)


class LocalServer:
    """`transformers serve MODEL` on 127.0.0.1:<free port>, pinned to that model (its name is the path given).

    Starts in `__enter__` (or `start()`), returns once `/v1/models` lists the loaded model, and stops the server
    (SIGTERM, then SIGKILL) on exit; it also dies with the process that started it. Its output goes to
    `log_path` (default: discarded) and the end of that log is in any start error. `threads` sets its torch
    threads on the CPU.
    """

    def __init__(self, model: str, *, device: str = "auto", threads: int | None = None, startup_timeout: float = 300.0,
                 log_path: str | None = None, port: int | None = None):
        self.model = model
        self.model_name = model  # a pinned server answers only to the name it was started with
        self.device, self.threads, self.startup_timeout = device, threads, startup_timeout
        self.log_path, self.port = log_path, port
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "LocalServer":
        require_serving()
        self.port = self.port or free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--device", self.device]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        # Its own session, so stopping it stops every process it started.
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=die_with_parent)
        if log is not subprocess.DEVNULL:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(f"transformers serve {self.model} exited with code {self.process.returncode}"
                                       f"{self._log_tail()}")
            try:
                models = requests.get(f"{self.base_url}/models", timeout=5).json()
                if any(m.get("id") == self.model_name for m in models.get("data", [])):
                    return self
            except (requests.exceptions.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"transformers serve {self.model} did not answer on {self.base_url} within "
                                       f"{self.startup_timeout:.0f} s{self._log_tail()}")
            time.sleep(0.25)

    def _log_tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "; its log ends:\n" + "".join(f.readlines()[-15:])

    def stop(self):
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=15)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait()

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc):
        self.stop()
