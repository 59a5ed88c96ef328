"""Server mode (`--vllm_mode server`): what the trainer's clients of both generation-server protocols share (images
as base64 PNG, a round's sampling, runs of a prompt's completions, one HTTP session whose failures are one-line
errors, waiting for GET /health), and the client of the older `trl vllm-serve` protocol, which vllm_serve.py serves.
vLLM's own `vllm serve` (TRL 1.16's `trl vllm-serve`) has its client in utils/core/vllm_serve_client.py;
utils.core.vllm_server_rollout.connect tells the two apart. The older protocol:

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

The group is utils/core/vllm_group.py's: NCCL on GPUs as TRL builds it, so a server of that TRL script works as it is;
a trainer on the CPU sends client_device_uuid "cpu" and joins over gloo. docs/distributed.md.
"""

from __future__ import annotations

import base64
import io
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch

from utils.core.http import HTTPFailure
from utils.core.http import request as http_request
from utils.core.vllm_group import CPU_DEVICE_UUID, weight_group

CONCURRENCY = 64  # requests in flight at once (TRL's number)
REQUEST_TIMEOUT = 1800.0  # seconds an attempt of one request may take (TRL's bound on a weight update)


class ServerError(RuntimeError):
    """The generation server answered with an error, or could not be reached."""


# ----------------------------------------------------------------------------------------------
# payloads
# ----------------------------------------------------------------------------------------------


def encode_image(image) -> str:
    """A PIL image as the protocols send it: base64 of its PNG bytes (lossless)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: str):
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[-1] if data.startswith("data:") else data)))
    image.load()
    return image


def round_sampling(cfg, *, stop_ids, suppress_ids, vocab_size):
    """One round's sampling, the HF path's: temperature, top-p, top-k (0: none), max tokens, the stop ids and the
    suppressed ids. Each protocol writes it in its own terms (`trl_generate_kwargs`, `vllm_sampling_params`)."""
    return dict(temperature=cfg.temperature, top_p=getattr(cfg, "top_p", 1.0), top_k=getattr(cfg, "top_k", None) or 0,
                max_tokens=cfg.max_completion_length, stop_token_ids=sorted(int(i) for i in stop_ids),
                suppress_ids=sorted(int(i) for i in suppress_ids or ()), vocab_size=int(vocab_size))


def prompt_runs(entries):
    """[ids, images, count, first entry] of each run of consecutive equal (prompt ids, images) in `entries`
    [(ids, images, ...)], one entry per completion: a group's completions asked for as one prompt."""
    runs = []
    for k, (ids, images, *_) in enumerate(entries):
        if runs and runs[-1][0] == ids and runs[-1][1] == images:
            runs[-1][2] += 1
        else:
            runs.append([ids, images, 1, k])
    return runs


def as_float(value):
    return math.nan if value is None else float(value)


# ----------------------------------------------------------------------------------------------
# HTTP, shared by both clients
# ----------------------------------------------------------------------------------------------


def server_base_url(base_url=None, host="0.0.0.0", port=8000) -> str:
    """TRL's rule: --vllm_server_base_url if given, else http://host:port."""
    if base_url:
        parsed = urlparse(base_url if "://" in base_url else f"http://{base_url}")
        if not parsed.hostname:
            raise ValueError(f"--vllm_server_base_url {base_url!r} names no host")
        return f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")
    return f"http://{host}:{int(port)}"


def one_line(text: str, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]


def local_address(host: str) -> str:
    """This machine's address on its route to `host`: where the server's workers reach a store the trainer holds
    (connecting a UDP socket picks the route and sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 1))
        return sock.getsockname()[0]


class ServerClient:
    """A generation server's base URL and its JSON requests (utils.core.http: each attempt bounded, retried where
    sending the work again is safe), whose failures are one-line errors."""

    slash = ""  # the older protocol's paths end in "/"

    def __init__(self, base_url: str, *, group_port: int = 51216, request_timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.host = socket.gethostbyname(urlparse(self.base_url).hostname)
        self.group_port, self.request_timeout = int(group_port), request_timeout or REQUEST_TIMEOUT
        self.group = None

    def _request(self, method: str, path: str, body=None, *, params=None, missing=None, retries=3) -> dict:
        """The JSON reply of one request. `missing`: what to do when the server does not serve `path` (404).
        `retries`: attempts after a connection error or a 5xx reply; 0 for the weight-update group's calls, whose
        other side (the broadcasts) must meet exactly one request. A reply that does not come within the request
        timeout is not asked for again (the server may still be working on it)."""
        where = f"vLLM server {self.base_url}: {method} /{path}{self.slash}"
        reply = http_request(method, f"{self.base_url}/{path}{self.slash}", what="vLLM server", json=body,
                             params=params, timeout=self.request_timeout, max_retries=retries, retry_timeouts=False,
                             failure=ServerError, timeout_error=ServerError)
        if reply.status == 404 and missing:
            raise ServerError(f"{where} is not served: {missing}")
        if reply.status != 200:
            raise ServerError(f"{where} answered {reply.status}: {one_line(reply.text)}")
        return reply.json()


def wait_for_server(base_url: str, total_timeout: float, retry_interval: float = 0.5) -> dict:
    """Wait up to `total_timeout` seconds for GET /health to answer 200 (--vllm_server_timeout); the reply's headers
    (X-Forwarded-For names the server's address behind a proxy, as TRL reads it)."""
    deadline = time.monotonic() + total_timeout
    while True:
        try:
            reply = http_request("GET", f"{base_url}/health", what="vLLM server", timeout=max(1.0, retry_interval),
                                 max_retries=0, quiet=True)
            if reply.status == 200:
                return reply.headers or {}
        except HTTPFailure:
            pass
        if time.monotonic() >= deadline:
            raise ServerError(f"no vLLM server answered at {base_url} within {total_timeout:g} s "
                              "(--vllm_server_timeout): start it first (`vllm serve ...`, `trl vllm-serve ...` or "
                              "`python vllm_serve.py ...`)")
        time.sleep(retry_interval)


def beside(request, work):
    """`work(reply)` here while `request()` runs in a thread (the two sides of one rendezvous); the request's answer.
    After an error the answer may never come: its thread is left behind, not waited for."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        reply = pool.submit(request)
        work(reply)
        return reply.result()
    finally:
        pool.shutdown(wait=False)


# ----------------------------------------------------------------------------------------------
# the older `trl vllm-serve` protocol (vllm_serve.py)
# ----------------------------------------------------------------------------------------------


def group_requests(entries):
    """(prompts, images, n) of one /generate/ request for `entries` [(prompt ids, images, ...)], one per completion in
    order: each run of equal entries is one prompt asked for several completions; n is the largest count that
    divides every run, so the n completions of each prompt come back in the entries' order."""
    runs = prompt_runs(entries)
    n = math.gcd(*[count for _, _, count, _ in runs])
    prompts = [(ids, images) for ids, images, count, _ in runs for _ in range(count // n)]
    return [p for p, _ in prompts], [i for _, i in prompts], n


def trl_generate_kwargs(sampling):
    """The /generate/ arguments of `round_sampling`: the suppressed tokens are left out of `allowed_token_ids`
    (logit_bias's keys would reach the server's SamplingParams as JSON strings), the stop ids sent as such."""
    extra = {"stop_token_ids": sampling["stop_token_ids"]}
    if sampling["suppress_ids"]:
        suppressed = set(sampling["suppress_ids"])
        extra["allowed_token_ids"] = [i for i in range(sampling["vocab_size"]) if i not in suppressed]
    return dict(temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"], min_p=0.0,
                repetition_penalty=1.0, max_tokens=sampling["max_tokens"], logprobs=0, generation_kwargs=extra)


def sampled_logprobs(response, completion_ids):
    """The log-prob of each sampled token from a /generate/ response (NaN where it is missing), or None when the
    server sent none. Each token's entry is TRL's [candidates' log-probs] with `logprob_token_ids` naming them (a
    server that names none: its first entry is the sampled token's)."""
    if not response.get("logprobs"):
        return None
    names = response.get("logprob_token_ids") or [[None] * len(row) for row in completion_ids]
    out = []
    for row, lps, ids in zip(completion_ids, response["logprobs"], names):
        seq = []
        for token, lp, candidates in zip(row, lps, ids):
            if not isinstance(lp, list):
                value = lp
            elif candidates is None:
                value = lp[0] if lp else None
            else:
                value = lp[candidates.index(token)] if token in candidates else None
            seq.append(as_float(value))
        out.append(seq + [math.nan] * (len(row) - len(seq)))
    return out


class VLLMClient(ServerClient):
    """The older `trl vllm-serve` protocol (vllm_serve.py): one /generate/ request per round, one
    /update_named_param/ per tensor, the trainer the group's last rank."""

    protocol, slash = "trl", "/"
    sends_frozen = False  # the workers keep the weights they loaded; only trainable ones change

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

    def sample(self, entries, sampling, image_token_id=None):
        """(prompt ids the server echoed, completion ids, sampled log-probs or None) of each entry (prompt ids, images,
        seed), in one request (the protocol takes no seeds: the server samples with its own)."""
        prompts, images, n = group_requests(entries)
        response = self.generate(prompts, images if any(images) else None, n=n, **trl_generate_kwargs(sampling))
        if len(response["completion_ids"]) != len(prompts) * n or len(response["prompt_ids"]) != len(prompts):
            raise ServerError(f"the vLLM server returned {len(response['completion_ids'])} completions of "
                              f"{len(response['prompt_ids'])} prompts for {len(prompts)} prompts x {n}")
        rows = response["completion_ids"]
        return [p for p in response["prompt_ids"] for _ in range(n)], rows, sampled_logprobs(response, rows)

    def init_weight_sync(self, device):
        """Join the server's weight-update group as its last rank (NCCL on a GPU, gloo on the CPU)."""
        device = torch.device(device)
        workers = self.world_size()
        uuid_ = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else CPU_DEVICE_UUID
        self._request("POST", "init_communicator", dict(host="0.0.0.0", port=self.group_port,
                                                        world_size=workers + 1, client_device_uuid=uuid_), retries=0)
        time.sleep(0.1)  # let the server's rank 0 open its store first (the client retries anyway)
        self.rank = workers
        self.group = weight_group(self.host, self.group_port, self.rank, workers + 1, device)

    init_communicator = init_weight_sync  # TRL's name

    def update_named_param(self, name: str, tensor: torch.Tensor):
        if self.group is None:
            raise RuntimeError("update_named_param before init_communicator")
        tensor = tensor.detach().contiguous()
        self._request("POST", "update_named_param", dict(name=name, dtype=str(tensor.dtype), shape=list(tensor.shape)),
                      retries=0)
        self.group.broadcast(tensor, src=self.rank)
        self.group.barrier()

    def push_weights(self, metadata, weights):
        """Each (name, tensor) of `weights` announced and broadcast on its own (`metadata` is vLLM's: unused here),
        then /reset_prefix_cache/, which also reports a push the server could not load."""
        for name, tensor in weights:
            self.update_named_param(name, tensor)
        self.reset_prefix_cache()

    def reset_prefix_cache(self):
        self._request("POST", "reset_prefix_cache", retries=0)

    def close_communicator(self):
        if self.group is not None:
            try:
                self._request("POST", "close_communicator", retries=0)
            except ServerError:
                pass  # the server may be gone already
            self.group = None
