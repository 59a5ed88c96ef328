"""Server mode (`--vllm_mode server`): TRL's `trl vllm-serve` protocol, both ends of it.

The generation server runs on other GPUs (`python vllm_serve.py --model ...`, or TRL's own server of the same
protocol); the trainer's main process talks to it over HTTP and joins a weight-update group with its workers:

    GET  /health/                  200 once the engine is up
    GET  /get_world_size/          {"world_size": tensor_parallel x data_parallel}
    POST /generate/                {"prompts": [[token ids]] or [str], "images": [[base64 PNG] | None] | None, "n",
                                    "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens",
                                    "logprobs", "structured_outputs_regex", "generation_kwargs": {...}}
                                   -> {"prompt_ids", "completion_ids" (n per prompt, prompt-major),
                                       "logprobs" [seq][token][k], "logprob_token_ids" [seq][token][k]}
    POST /init_communicator/       {"host", "port", "world_size", "client_device_uuid"}: the server's workers join
                                   the group as ranks 0..W-1 (rank 0 holds its TCP store at host:port), the trainer
                                   as rank W; the reply comes at once and the trainer then joins
    POST /update_named_param/      {"name", "dtype", "shape"}: the reply comes at once; the trainer then broadcasts
                                   the tensor from rank W, and every rank passes a barrier; the workers load it
    POST /reset_prefix_cache/      after a round of updates
    POST /close_communicator/

On GPUs the group is vLLM's `StatelessProcessGroup` with its NCCL communicator, exactly as TRL builds it, so a server
of TRL's script works as is. A trainer on the CPU (client_device_uuid "cpu": the tests' stand-in server, or a CPU
trainer against a GPU server) joins a gloo group over a `TCPStore` that the server's rank 0 holds, under the prefix
"client2server" (TRL's non-NCCL path, with gloo in place of XCCL). docs/distributed.md.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch

GROUP_PREFIX = "client2server"
CPU_DEVICE_UUID = "cpu"  # what a CPU trainer sends as client_device_uuid (a GPU sends its CUDA device's UUID)


class ServerError(RuntimeError):
    """The generation server answered with an error, or could not be reached."""


# ----------------------------------------------------------------------------------------------
# payloads
# ----------------------------------------------------------------------------------------------


def encode_image(image) -> str:
    """A PIL image as the protocol sends it: base64 of its PNG bytes (lossless)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: str):
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


def torch_dtype(name: str) -> torch.dtype:
    """'torch.bfloat16' (what the protocol sends) or 'bfloat16' -> torch.bfloat16."""
    dtype = getattr(torch, str(name).rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# ----------------------------------------------------------------------------------------------
# the weight-update group
# ----------------------------------------------------------------------------------------------


class GlooGroup:
    """The CPU weight-update group: a TCPStore held by rank 0 at host:port, a gloo group under GROUP_PREFIX."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float = 300.0):
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        wait = timedelta(seconds=timeout)
        self.store = TCPStore(host, int(port), int(world_size), is_master=rank == 0, timeout=wait)
        self.group = ProcessGroupGloo(PrefixStore(GROUP_PREFIX, self.store), int(rank), int(world_size), wait)

    def broadcast(self, tensor: torch.Tensor, src: int):
        self.group.broadcast(tensor, src).wait()

    def barrier(self):
        self.group.barrier().wait()


class NcclGroup:
    """The GPU weight-update group, built as TRL builds it: vLLM's StatelessProcessGroup and PyNcclCommunicator."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host=host, port=int(port), rank=int(rank),
                                                  world_size=int(world_size))
        self.communicator = PyNcclCommunicator(self.group, device=device)

    def broadcast(self, tensor: torch.Tensor, src: int):
        self.communicator.broadcast(tensor, src=src)

    def barrier(self):
        self.group.barrier()


def weight_group(host, port, rank, world_size, device, timeout=300.0):
    """NCCL for CUDA tensors, gloo otherwise."""
    if torch.device(device).type == "cuda":
        return NcclGroup(host, port, rank, world_size, device)
    return GlooGroup(host, port, rank, world_size, timeout)


class WeightSyncWorkerExtension:
    """The server side of the group inside each vLLM worker (`vllm.LLM(worker_extension_cls=...)`, called through
    `collective_rpc`): the protocol's init_communicator / update_named_param / close_communicator."""

    communicator = None
    client_rank = None

    def init_communicator(self, host, port, world_size, client_device_uuid):
        from vllm.distributed.parallel_state import get_world_group

        if self.communicator is not None:
            raise RuntimeError("the weight-update group is already open; close it first (/close_communicator/)")
        device = torch.device(self.device)
        if device.type == "cuda" and client_device_uuid == str(torch.cuda.get_device_properties(device).uuid):
            raise RuntimeError(f"the trainer and this vLLM worker share the GPU {client_device_uuid}: give the server "
                               "its own GPUs (CUDA_VISIBLE_DEVICES)")
        # a trainer on the CPU joins over gloo: the weights arrive in host memory and are loaded from there
        self.group_device = torch.device("cpu") if client_device_uuid == CPU_DEVICE_UUID else device
        self.communicator = weight_group(host, port, get_world_group().rank, world_size, self.group_device)
        self.client_rank = int(world_size) - 1

    def update_named_param(self, name, dtype, shape):
        if self.communicator is None:
            raise RuntimeError("no weight-update group: call /init_communicator/ first")
        weight = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.group_device)
        self.communicator.broadcast(weight, src=self.client_rank)
        self.communicator.barrier()
        self.model_runner.model.load_weights(weights=[(name, weight)])

    def close_communicator(self):
        self.communicator = self.client_rank = None


# ----------------------------------------------------------------------------------------------
# the client
# ----------------------------------------------------------------------------------------------


def server_base_url(base_url=None, host="0.0.0.0", port=8000) -> str:
    """TRL's rule: --vllm_server_base_url if given, else http://host:port."""
    if base_url:
        parsed = urlparse(base_url if "://" in base_url else f"http://{base_url}")
        if not parsed.hostname:
            raise ValueError(f"--vllm_server_base_url {base_url!r} names no host")
        return f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")
    return f"http://{host}:{int(port)}"


class VLLMClient:
    """The trainer's side of the protocol (one client, in the main process)."""

    def __init__(self, base_url: str, *, group_port: int = 51216, connection_timeout: float = 240.0,
                 request_timeout: float | None = None):
        import requests

        self.base_url = base_url.rstrip("/")
        self.host = socket.gethostbyname(urlparse(self.base_url).hostname)
        self.group_port, self.request_timeout = int(group_port), request_timeout
        self.session = requests.Session()
        self.group, self.rank = None, None
        self.check_server(connection_timeout)

    # -- HTTP --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body=None) -> dict:
        import requests

        url = f"{self.base_url}/{path}/"
        try:
            response = self.session.request(method, url, timeout=self.request_timeout,
                                            data=None if body is None else json.dumps(body),
                                            headers={"Content-Type": "application/json"})
        except requests.RequestException as err:
            raise ServerError(f"vLLM server {self.base_url}: {method} /{path}/ failed: {err}") from None
        if response.status_code != 200:
            raise ServerError(f"vLLM server {self.base_url}: {method} /{path}/ answered {response.status_code}: "
                              f"{response.text[:500]}")
        return response.json()

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 0.5):
        """Wait up to `total_timeout` seconds for GET /health/ to answer 200 (--vllm_server_timeout)."""
        import requests

        deadline = time.monotonic() + total_timeout
        while True:
            try:
                response = self.session.get(f"{self.base_url}/health/", timeout=max(1.0, retry_interval))
                if response.status_code == 200:
                    self.host = response.headers.get("X-Forwarded-For", self.host)
                    return
            except requests.RequestException:
                pass
            if time.monotonic() >= deadline:
                raise ServerError(f"no vLLM server answered at {self.base_url} within {total_timeout:g} s "
                                  "(--vllm_server_timeout): start it first, e.g. `python vllm_serve.py --model ...`")
            time.sleep(retry_interval)

    def world_size(self) -> int:
        return int(self._request("GET", "get_world_size")["world_size"])

    def generate(self, prompts, images=None, *, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None) -> dict:
        """n completions per prompt. `images`: per prompt a list of PIL images or None."""
        if images is not None:
            images = [[encode_image(im) for im in imgs] if imgs else None for imgs in images]
        body = dict(prompts=prompts, images=images, n=n, repetition_penalty=repetition_penalty,
                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens,
                    logprobs=logprobs, structured_outputs_regex=structured_outputs_regex,
                    generation_kwargs=generation_kwargs or {})
        return self._request("POST", "generate", body)

    # -- weights -----------------------------------------------------------------------------

    def init_communicator(self, device):
        """Join the server's weight-update group as its last rank (NCCL on a GPU, gloo on the CPU)."""
        device = torch.device(device)
        workers = self.world_size()
        uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else CPU_DEVICE_UUID
        self._request("POST", "init_communicator", dict(host="0.0.0.0", port=self.group_port,
                                                        world_size=workers + 1, client_device_uuid=uuid))
        time.sleep(0.1)  # let the server's rank 0 open its store first (the client retries anyway)
        self.rank = workers
        self.group = weight_group(self.host, self.group_port, self.rank, workers + 1, device)

    def update_named_param(self, name: str, tensor: torch.Tensor):
        if self.group is None:
            raise RuntimeError("update_named_param before init_communicator")
        tensor = tensor.detach().contiguous()
        self._request("POST", "update_named_param", dict(name=name, dtype=str(tensor.dtype), shape=list(tensor.shape)))
        self.group.broadcast(tensor, src=self.rank)
        self.group.barrier()

    def reset_prefix_cache(self):
        self._request("POST", "reset_prefix_cache")

    def close_communicator(self):
        if self.group is not None:
            try:
                self._request("POST", "close_communicator")
            except ServerError:
                pass  # the server may be gone already
            self.group = None
