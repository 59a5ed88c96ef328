"""A generation server for `train_grpo.py --use_vllm --vllm_mode server`: vLLM's engine behind the older `trl
vllm-serve` HTTP protocol (utils/core/vllm_client.py lists the endpoints), on GPUs of its own.

    CUDA_VISIBLE_DEVICES=7 python vllm_serve.py --model Qwen/Qwen2.5-VL-7B-Instruct --port 8000
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 accelerate launch --num_processes 7 train_grpo.py --use_vllm \
        --vllm_mode server --vllm_server_host 127.0.0.1 --config recipes/crystal_cpr.yaml

The trainer speaks vLLM's own `vllm serve` too (what TRL 1.16's `trl vllm-serve` runs; docs/distributed.md). The flags
are those of the TRL releases whose `trl vllm-serve` was a script of this protocol (its servers serve our trainer, and
this one serves their GRPOTrainer), plus `--mm_processor_kwargs` / `--limit_mm_per_prompt` for vision-language models:
the trainer sends its own prompt token ids, image placeholders already expanded, so the server's image processor must
size each image as the trainer's did (the trainer checks the echoed ids and names the flag when they differ). Requests
queue and run one at a time on the engine, in the order they came: weight updates that arrive before a generate
request are loaded before it runs. docs/distributed.md.
"""

import json
import os
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

REPO = os.path.dirname(os.path.abspath(__file__))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from utils.core.config import ConfigError, parse_config  # noqa: E402
from utils.core.vllm_client import decode_image  # noqa: E402


@dataclass
class ServeConfig:
    """The generation server of `train_grpo.py --use_vllm --vllm_mode server`: vLLM's engine behind TRL's `trl
    vllm-serve` HTTP protocol, on GPUs of its own. The flags are `trl vllm-serve`'s, plus --mm_processor_kwargs and
    --limit_mm_per_prompt for vision-language models (the server's image processor must size each image as the
    trainer's does). docs/distributed.md."""

    model: str = field(metadata={"help": "hub name or folder of the model to serve (the trainer's starting model)"})
    revision: Optional[str] = None  # hub revision of --model
    tensor_parallel_size: int = 1  # GPUs the engine shards the model over
    data_parallel_size: int = 1  # engine copies; only 1 here (TRL's script runs several)
    host: str = "0.0.0.0"  # address to listen on
    port: int = 8000  # HTTP port
    gpu_memory_utilization: float = 0.9  # share of each GPU's memory the engine may take
    dtype: str = "auto"  # weights dtype (auto: the checkpoint's)
    max_model_len: Optional[int] = None  # context window; none: the model's
    enable_prefix_caching: Optional[bool] = None  # reuse the KV cache of shared prompt prefixes; none: vLLM's default
    enforce_eager: bool = False  # no CUDA graphs: faster start, slower decoding
    kv_cache_dtype: str = "auto"  # KV cache dtype
    trust_remote_code: bool = False  # run the model repository's own code
    log_level: str = "info"  # server log level: critical, error, warning, info, debug
    vllm_model_impl: str = "vllm"  # model implementation: vllm or transformers
    mm_processor_kwargs: dict = field(default_factory=dict, metadata={"help": (
        'image processor overrides as JSON, e.g. {"max_pixels": 401408} for the trainer\'s --max_pixels 401408')})
    limit_mm_per_prompt: dict = field(default_factory=dict, metadata={"help": (
        'most images (videos) per prompt as JSON, e.g. {"image": 4}; none: vLLM\'s default')})
    seed: int = 0  # engine seed (requests are not seeded)


def check_config(cfg: ServeConfig):
    if cfg.data_parallel_size != 1:
        raise ConfigError("--data_parallel_size: this server runs one engine; start one server per GPU group and "
                          "give each trainer its own, or use --tensor_parallel_size")
    if cfg.tensor_parallel_size < 1:
        raise ConfigError(f"--tensor_parallel_size {cfg.tensor_parallel_size} must be >= 1")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu_memory_utilization {cfg.gpu_memory_utilization} must be in (0, 1]")
    if cfg.vllm_model_impl not in ("vllm", "transformers", "auto"):
        raise ConfigError(f"--vllm_model_impl {cfg.vllm_model_impl!r} is not vllm, transformers or auto")


# ----------------------------------------------------------------------------------------------
# the protocol (any engine: vLLM here, transformers in the tests' stand-in)
# ----------------------------------------------------------------------------------------------

# TRL's GenerateRequest fields and defaults
GENERATE_DEFAULTS = dict(images=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                         max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs={})
REQUIRED = {"generate": ("prompts",), "init_communicator": ("host", "port", "world_size", "client_device_uuid"),
            "update_named_param": ("name", "dtype", "shape")}


class BadRequest(ValueError):
    """A request body the protocol does not accept (HTTP 422, as FastAPI answers)."""


def generate_request(body: dict) -> dict:
    """The /generate/ body with TRL's defaults filled in, checked."""
    request = {**GENERATE_DEFAULTS, **body}
    prompts, images = request["prompts"], request["images"]
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest("prompts must be a non-empty list of strings or of token id lists")
    if images is not None and len(images) != len(prompts):
        raise BadRequest(f"{len(images)} image lists for {len(prompts)} prompts")
    if not isinstance(request["generation_kwargs"], dict):
        raise BadRequest("generation_kwargs must be an object")
    return request


class ProtocolServer:
    """TRL's vllm-serve endpoints over `engine`, which has `world_size` and the methods generate(request) ->
    response, init_communicator(host, port, world_size, client_device_uuid), update_named_param(name, dtype, shape),
    reset_prefix_cache(), close_communicator(). HTTP runs in threads; the engine runs in the thread that calls
    `serve_forever` (the main one: vLLM wants it), one command at a time, in arrival order. The group commands answer
    at once (the trainer broadcasts after the reply); an error in one is reported by the next waited-for request."""

    def __init__(self, engine, host: str, port: int):
        self.engine, self.commands = engine, queue.Queue()
        self.failure = None  # the error of a command nobody waited for
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def submit(self, method: str, args=(), wait=True):
        done, box = threading.Event(), {}
        self.commands.put((method, args, done, box, wait))
        if not wait:
            return {"message": f"Request received, {method}"}
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def serve_forever(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        while True:
            item = self.commands.get()
            if item is None:
                return
            method, args, done, box, waited = item
            try:
                if waited and self.failure is not None:
                    failure, self.failure = self.failure, None
                    raise RuntimeError(f"an earlier request failed: {failure}")
                box["result"] = getattr(self.engine, method)(*args)
            except Exception as err:  # noqa: BLE001 - reported to the client
                traceback.print_exc()
                if waited:
                    box["error"] = err
                else:
                    self.failure = f"{method}{args[:1]}: {type(err).__name__}: {err}"
            done.set()

    def shutdown(self):
        self.commands.put(None)
        self.httpd.shutdown()

    def handle(self, method: str, path: str, body: dict):
        """(status, reply) of one request."""
        route = path.split("?")[0].strip("/")
        if method == "GET" and route == "health":
            return 200, {"status": "ok"}
        if method == "GET" and route == "get_world_size":
            return 200, {"world_size": self.engine.world_size}
        if method != "POST" or route not in ("generate", "init_communicator", "update_named_param",
                                             "reset_prefix_cache", "close_communicator"):
            return 404, {"detail": f"{method} /{route}/ is not served here"}
        missing = [k for k in REQUIRED.get(route, ()) if k not in body]
        if missing:
            return 422, {"detail": f"/{route}/ needs {', '.join(missing)}"}
        if route == "generate":
            return 200, self.submit("generate", (generate_request(body),))
        if route == "init_communicator":  # the server's workers and the trainer: W + 1 ranks (TRL's count)
            args = (body["host"], int(body["port"]), self.engine.world_size + 1, str(body["client_device_uuid"]))
            return 200, self.submit("init_communicator", args, wait=False)
        if route == "update_named_param":
            args = (str(body["name"]), str(body["dtype"]), tuple(int(s) for s in body["shape"]))
            return 200, self.submit("update_named_param", args, wait=False)
        if route == "close_communicator":
            return 200, self.submit("close_communicator", wait=False)
        self.submit("reset_prefix_cache")
        return 200, {"message": "Request received, resetting prefix cache status: True"}


def _handler(server: ProtocolServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method):
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                status, payload = server.handle(method, self.path, body)
            except (BadRequest, json.JSONDecodeError) as err:
                status, payload = 422, {"detail": str(err)}
            except Exception as err:  # noqa: BLE001 - the engine's error, for the client
                status, payload = 500, {"detail": f"{type(err).__name__}: {err}"}
            self._reply(status, payload)

        def do_GET(self):  # noqa: N802 - http.server's name
            self._serve("GET")

        def do_POST(self):  # noqa: N802
            self._serve("POST")

        def log_message(self, fmt, *args):
            pass

    return Handler


def logprob_lists(entries, token_ids):
    """TRL's extract_logprobs for one sequence: per token, [log-prob] of its candidates by rank (None for NaN), and
    their ids. `entries`: vLLM's per-token dicts {token id: Logprob(logprob, rank)}."""
    logprobs, ids = [], []
    for entry in entries:
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 0)
        ids.append([int(t) for t, _ in ranked])
        logprobs.append([None if lp.logprob != lp.logprob else float(lp.logprob) for _, lp in ranked])
    return logprobs, ids


# ----------------------------------------------------------------------------------------------
# vLLM's engine
# ----------------------------------------------------------------------------------------------


class VLLMEngine:
    def __init__(self, cfg: ServeConfig):
        # the workers import the weight-sync extension by name: they must find this repository
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM

        kwargs = dict(model=cfg.model, revision=cfg.revision, tensor_parallel_size=cfg.tensor_parallel_size,
                      gpu_memory_utilization=cfg.gpu_memory_utilization, dtype=cfg.dtype,
                      max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager,
                      kv_cache_dtype=cfg.kv_cache_dtype, trust_remote_code=cfg.trust_remote_code,
                      model_impl=cfg.vllm_model_impl, seed=cfg.seed,
                      worker_extension_cls="utils.core.vllm_group.WeightSyncWorkerExtension",
                      # the log-probs of what was sampled, after temperature: what the trainer's importance
                      # sampling correction compares with its own
                      logprobs_mode="processed_logprobs")
        if cfg.enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = cfg.enable_prefix_caching
        if cfg.mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = cfg.mm_processor_kwargs
        if cfg.limit_mm_per_prompt:
            kwargs["limit_mm_per_prompt"] = cfg.limit_mm_per_prompt
        self.llm = LLM(**kwargs)
        self.world_size = cfg.tensor_parallel_size * cfg.data_parallel_size

    def generate(self, request):
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        prompts = []
        for prompt, images in zip(request["prompts"], request["images"] or [None] * len(request["prompts"])):
            row = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
            if images:
                row["multi_modal_data"] = {"image": [decode_image(im) for im in images]}
            prompts.append(row)
        kwargs = {k: request[k] for k in ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
                                          "max_tokens", "logprobs")}
        kwargs.update(request["generation_kwargs"])
        if request["structured_outputs_regex"] is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(regex=request["structured_outputs_regex"])
        outputs = self.llm.generate(prompts, SamplingParams(**kwargs), use_tqdm=False)
        response = dict(prompt_ids=[list(o.prompt_token_ids) for o in outputs],
                        completion_ids=[list(c.token_ids) for o in outputs for c in o.outputs],
                        logprobs=None, logprob_token_ids=None)
        if all(c.logprobs is not None for o in outputs for c in o.outputs):
            pairs = [logprob_lists(c.logprobs, c.token_ids) for o in outputs for c in o.outputs]
            response.update(logprobs=[p[0] for p in pairs], logprob_token_ids=[p[1] for p in pairs])
        return response

    def init_communicator(self, host, port, world_size, client_device_uuid):
        self.llm.collective_rpc("init_communicator", args=(host, port, world_size, client_device_uuid))

    def update_named_param(self, name, dtype, shape):
        self.llm.collective_rpc("update_named_param", args=(name, dtype, shape))

    def reset_prefix_cache(self):
        self.llm.reset_prefix_cache()

    def close_communicator(self):
        self.llm.collective_rpc("close_communicator")


def main(cfg: ServeConfig):
    check_config(cfg)
    engine = VLLMEngine(cfg)  # before the port opens: /health/ answers once the engine is up
    server = ProtocolServer(engine, cfg.host, cfg.port)
    print(f"vllm_serve.py: serving {cfg.model} on http://{cfg.host}:{server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(parse_config(ServeConfig, sys.argv[1:]))
