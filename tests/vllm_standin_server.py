"""A stand-in for a vLLM generation server on the CPU, over an engine that generates with transformers and joins the
weight-update group over gloo. It speaks either protocol (utils/core/vllm_client.py, utils/core/vllm_serve_client.py):

    python tests/vllm_standin_server.py --model FOLDER --port P [--protocol trl|vllm] [--dump_dir DIR]

`--protocol trl` (the older `trl vllm-serve` one): vllm_serve.py's own protocol server (the same endpoints, command
queue and error reports). `--protocol vllm`: the endpoints of vLLM's `vllm serve` that TRL 1.16's client and ours use
(/health, /v1/models, /server_info, /get_world_size, /v1/completions, /v1/chat/completions/render,
/inference/v1/generate, /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
/reset_prefix_cache) with their payloads, the trainer rank 0 of the group. `--no_dev_mode`, `--no_scale_out`,
`--weight_transfer none|nccl` and `--logprobs_mode` start it as a `vllm serve` missing a setting answers.

It samples with the project's HF sampler (utils.core.rollout.generate_completions: stop ids, suppressed tokens,
temperature / top-k / top-p; a seeded request's k-th completion from seed + k, as vLLM) and returns the log-probs of
the sampled tokens at the request's temperature, computed as the trainer computes them (so a trainer whose pushed
weights arrived sees a gap of 0). With --dump_dir it records what it was asked (requests.jsonl), the weight protocol's
calls in order (events.jsonl) and, at the end of every weight update (/reset_prefix_cache/ of the older protocol,
/finish_weight_update of vLLM's), all its weights (sync-<k>.safetensors, k = 0, 1, ...): the tests compare those with
the trainer's checkpoints."""

import argparse
import hashlib
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from utils.core.encoding import encode_prompts  # noqa: E402
from utils.core.logprobs import CompletionLogProbs  # noqa: E402
from utils.core.models import image_token_id, load_model_and_processor  # noqa: E402
from utils.core.prompts import build_messages  # noqa: E402
from utils.core.rollout import generate_completions, stop_token_ids  # noqa: E402
from utils.core.vllm_client import decode_image, encode_image  # noqa: E402
from utils.core.vllm_group import GlooGroup, torch_dtype  # noqa: E402
from utils.core.vllm_rollout import prompt_token_ids  # noqa: E402
from utils.core.vllm_serve_client import SUPPRESS_BIAS, image_token_runs  # noqa: E402
from vllm_serve import BadRequest, ProtocolServer  # noqa: E402

# The fields vLLM's request models know (vllm/entrypoints/openai/completion/protocol.py CompletionRequest,
# vllm/entrypoints/serve/disagg/protocol.py GenerateRequest, vllm/sampling_params.py SamplingParams,
# vllm/distributed/weight_transfer/nccl_engine.py NCCLInitInfo / NCCLUpdateInfo). vLLM logs and drops a field it does
# not know; the stand-in refuses it (400), so a misspelt field fails the tests instead of being ignored.
COMPLETION_FIELDS = {
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "prompt_embeds", "add_special_tokens", "response_format",
    "structured_outputs", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs"}
GENERATE_FIELDS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream", "stream_options",
                   "cache_salt", "priority", "kv_transfer_params"}
SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "truncate_prompt_tokens", "output_kind", "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args",
    "bad_words"}
INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size"}  # NCCLInitInfo: all required
INIT_OPTIONS = {"packed"}  # vLLM >= 0.28 sets packing when the group opens (TRL 1.16 sends True there)
UPDATE_FIELDS = {"names", "dtype_names", "shapes", "packed"}  # NCCLUpdateInfo: packed optional (False)
START_FIELDS = {"include_draft", "is_checkpoint_format"}  # what /start_weight_update reads (older vLLM: the second)


def check_fields(what, body, known, required=()):
    """A request whose fields vLLM would not take (unknown: vLLM drops them; missing required ones: 400) -> 400."""
    if not isinstance(body, dict):
        raise BadRequest(f"{what}: a JSON object, not {type(body).__name__}")
    unknown, missing = sorted(set(body) - set(known)), [k for k in required if k not in body]
    if unknown or missing:
        raise BadRequest(f"{what}: unknown fields {unknown}" if unknown else f"{what}: missing fields {missing}")


class HFEngine:
    world_size = 1
    protocol = "trl"  # the older protocol's weight update ends at /reset_prefix_cache/; VLLMServeStandIn sets "vllm"

    def __init__(self, model_path, *, bind_host="127.0.0.1", dump_dir=None, seed=0, max_pixels=None,
                 logprobs_mode="processed_logprobs"):
        self.model, self.processor = load_model_and_processor(model_path, max_pixels=max_pixels)
        self.model.eval().requires_grad_(False)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.image_token_id = image_token_id(self.processor)
        self.scorer = CompletionLogProbs(self.model)
        self.params = dict(self.model.named_parameters())
        self.bind_host, self.dump_dir, self.seed, self.logprobs_mode = bind_host, dump_dir, seed, logprobs_mode
        self.group = self.client_rank = None
        self.calls, self.syncs, self.updating = 0, 0, False
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)

    # -- generation, both protocols ---------------------------------------------------------

    def batch(self, rows, images):
        """Left-padded model inputs for prompt token ids whose image placeholders are already expanded."""
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        batch = {"input_ids": ids, "attention_mask": mask}
        flat = [im for imgs in images for im in (imgs or [])]
        if flat:
            batch.update(self.processor.image_processor(images=flat, return_tensors="pt"))
            if "mm_token_type_ids" in getattr(self.processor, "model_input_names", ()):
                batch["mm_token_type_ids"] = (ids == self.image_token_id).long()
        return batch

    @torch.no_grad()
    def sample(self, rows, images, seeds, *, temperature, top_p, top_k, max_tokens, stop_ids, suppress):
        """One completion per row (prompt ids, images, seed): (completion ids, log-probs of the sampled tokens)."""
        if self.updating:
            raise RuntimeError("generation requested inside a weight update (between /start_weight_update and "
                               "/finish_weight_update)")
        batch = self.batch(rows, images)
        ids, mask = generate_completions(
            self.model, batch, row_seeds=torch.tensor(seeds), max_new_tokens=max_tokens, temperature=temperature,
            top_k=top_k if top_k and top_k > 0 else None, top_p=top_p, eos_token_id=stop_ids or stop_token_ids(
                self.model, self.tokenizer), pad_token_id=self.tokenizer.pad_token_id, suppress_token_ids=suppress)
        scale = temperature if self.logprobs_mode == "processed_logprobs" else 1.0
        logps = self.scorer(batch, ids, mask, scale)
        return ([c[m.bool()].tolist() for c, m in zip(ids, mask)],
                [lp[m.bool()].tolist() for lp, m in zip(logps, mask)])

    def record(self, name, row):
        if self.dump_dir:
            with open(os.path.join(self.dump_dir, name), "a") as f:
                f.write(json.dumps(row) + "\n")

    def dump_weights(self):
        if self.dump_dir:
            state = {k: v.detach().clone().contiguous() for k, v in self.model.state_dict().items()}
            save_file(state, os.path.join(self.dump_dir, f"sync-{self.syncs}.safetensors"))
        self.syncs += 1

    # -- the older `trl vllm-serve` protocol --------------------------------------------------

    def generate(self, request):
        n, rows = request["n"], request["prompts"]
        if not isinstance(rows[0], list):
            rows = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in rows]
        images = [[decode_image(im) for im in imgs] if imgs else [] for imgs in
                  (request["images"] or [None] * len(rows))]
        extra = request["generation_kwargs"]
        stop = extra.get("stop_token_ids") or stop_token_ids(self.model, self.tokenizer)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        allowed = extra.get("allowed_token_ids")
        suppress = sorted(set(range(vocab)) - set(allowed)) if allowed is not None else []
        expanded = [k for k in range(len(rows)) for _ in range(n)]
        seeds = [self.seed * 1_000_003 + self.calls * 100_003 + j for j in range(len(expanded))]
        self.calls += 1
        completions, scores = self.sample(
            [rows[k] for k in expanded], [images[k] for k in expanded], seeds, temperature=request["temperature"],
            top_p=request["top_p"], top_k=request["top_k"], max_tokens=request["max_tokens"], stop_ids=stop,
            suppress=suppress)
        self.record("requests.jsonl", dict(
            call=self.calls, prompts=len(rows), n=n, images=[len(i) for i in images],
            temperature=request["temperature"], max_tokens=request["max_tokens"], top_p=request["top_p"],
            top_k=request["top_k"], stop_token_ids=list(stop), suppressed=len(suppress), keys=sorted(extra)))
        return dict(prompt_ids=[list(r) for r in rows], completion_ids=completions,
                    logprobs=[[[lp] for lp in s] for s in scores] if request["logprobs"] is not None else None,
                    logprob_token_ids=[[[t] for t in c] for c in completions])

    def init_communicator(self, host, port, world_size, client_device_uuid):
        # rank 0 holds the store: on loopback here (the request's 0.0.0.0 would listen on every interface)
        self.group = GlooGroup(self.bind_host, port, 0, world_size, timeout=120.0)
        self.client_rank = world_size - 1

    def update_named_param(self, name, dtype, shape):
        weight = torch.empty(tuple(shape), dtype=torch_dtype(dtype))
        self.group.broadcast(weight, src=self.client_rank)
        self.group.barrier()
        if name not in self.params:
            raise KeyError(f"no parameter {name!r} in the served model")
        self.params[name].data.copy_(weight)

    def reset_prefix_cache(self):
        if self.protocol == "trl":  # the older protocol: the end of a round of updates
            self.dump_weights()
        self.record("events.jsonl", {"event": "reset_prefix_cache"})
        return {"success": True}

    def close_communicator(self):
        self.group = None

    # -- vLLM's `vllm serve` ------------------------------------------------------------------

    def sampling(self, params):
        """HF sampling arguments from vLLM's sampling parameters (a suppressing logit bias only)."""
        bias = {int(k): float(v) for k, v in (params.get("logit_bias") or {}).items()}
        if any(v > SUPPRESS_BIAS for v in bias.values()):
            raise BadRequest("the stand-in applies suppressing logit biases only (<= -100)")
        return dict(temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
                    top_k=params.get("top_k", 0), max_tokens=params.get("max_tokens", 16),
                    stop_ids=list(params.get("stop_token_ids") or []), suppress=sorted(bias))

    def seeds(self, params):
        n = int(params.get("n", 1))
        if params.get("seed") is None:
            self.calls += 1
            return [self.seed * 1_000_003 + self.calls * 100_003 + j for j in range(n)]
        return [int(params["seed"]) + j for j in range(n)]  # vLLM: the k-th of n completions from seed + k

    def completions(self, body):
        """Prompts of token ids (TRL's form: a list of them), n completions each, prompt-major; the k-th completion of
        each prompt sampled from seed + k (vLLM's SamplingParams are shared by the prompts of a request)."""
        prompts = body["prompt"]
        seeds, sampling = self.seeds(body), self.sampling(body)
        completions, scores = self.sample([p for p in prompts for _ in seeds], [[]] * len(prompts) * len(seeds),
                                          seeds * len(prompts), **sampling)
        self.record("events.jsonl", {"event": "v1/completions"})
        self.record("requests.jsonl", dict(path="v1/completions", prompts=len(prompts), n=len(seeds), images=[0],
                                           seed=body.get("seed"), **{k: body.get(k) for k in (
                                               "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids")},
                                           suppressed=len(sampling["suppress"])))
        choices = []
        for k, (completion, score) in enumerate(zip(completions, scores)):
            as_ids = body.get("return_tokens_as_token_ids")
            tokens = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t]) for t in completion]
            logprobs = None if body.get("logprobs") is None else {
                "text_offset": list(range(len(completion))), "tokens": tokens, "token_logprobs": score,
                "top_logprobs": [{token: lp} for token, lp in zip(tokens, score)]}
            choice = {"index": k, "text": self.tokenizer.decode(completion), "logprobs": logprobs,
                      "finish_reason": "stop", "stop_reason": None}
            if body.get("return_token_ids"):  # vLLM sends the ids only when asked
                choice.update(token_ids=completion, prompt_token_ids=list(prompts[k // len(seeds)]))
            choices.append(choice)
        return {"object": "text_completion", "model": body.get("model"), "choices": choices}

    def render(self, body):
        """A conversation of images alone through the chat template: features whose placeholders are the runs of
        image tokens there, the images themselves (PNG) as the processed data."""
        images = [decode_image(part["image_url"]["url"]) for message in body["messages"]
                  for part in (message["content"] if isinstance(message["content"], list) else ())
                  if part.get("type") == "image_url"]
        batch = encode_prompts(self.processor, [build_messages("", num_images=len(images), template="plain")],
                               [images], sample_ids=["render"])
        runs = image_token_runs(prompt_token_ids(batch)[0], self.image_token_id)
        data = [encode_image(image) for image in images]
        return {"features": {"mm_hashes": {"image": [hashlib.sha256(d.encode()).hexdigest() for d in data]},
                             "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in runs]},
                             "kwargs_data": {"image": data}}}

    def generate_tokens(self, body):
        ids, features, params = body["token_ids"], body.get("features") or {}, body["sampling_params"]
        data = (features.get("kwargs_data") or {}).get("image") or []
        placed = (features.get("mm_placeholders") or {}).get("image") or []
        if [(p["offset"], p["length"]) for p in placed] != image_token_runs(ids, self.image_token_id):
            raise BadRequest(f"placeholders {placed} are not the runs of image tokens of the prompt")
        if len(data) != len(placed) or (features.get("mm_hashes") or {}).get("image") != [
                hashlib.sha256(d.encode()).hexdigest() for d in data]:
            raise BadRequest("features: one processed image and its hash per placeholder")
        if params.get("output_kind") != 2:
            raise BadRequest("without output_kind 2 (FINAL_ONLY) vLLM answers with the last finished sequence only")
        images = [decode_image(d) for d in data]
        seeds, sampling = self.seeds(params), self.sampling(params)
        completions, scores = self.sample([ids] * len(seeds), [images] * len(seeds), seeds, **sampling)
        self.record("events.jsonl", {"event": "inference/v1/generate"})
        self.record("requests.jsonl", dict(path="inference/v1/generate", prompts=1, n=len(seeds), images=[len(images)],
                                           seed=params.get("seed"), **{k: params.get(k) for k in (
                                               "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids")},
                                           suppressed=len(sampling["suppress"])))
        choices = [{"index": k, "token_ids": c, "finish_reason": "stop", "logprobs": None if params.get(
            "logprobs") is None else {"content": [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                                                  for t, lp in zip(c, s)]}}
                   for k, (c, s) in enumerate(zip(completions, scores))]
        return {"request_id": body.get("request_id"), "choices": choices}

    def init_weight_transfer_engine(self, init_info):
        # the trainer is rank 0 and holds the store; this engine's one worker joins as rank 0 + rank_offset
        self.group = GlooGroup(init_info["master_address"], init_info["master_port"], init_info["rank_offset"],
                               init_info["world_size"], timeout=120.0)
        self.record("events.jsonl", {"event": "init_weight_transfer_engine", **init_info})
        return {"message": "Weight transfer initialized"}

    def start_weight_update(self):
        self.updating = True
        self.record("events.jsonl", {"event": "start_weight_update"})
        return {"message": "Weight update started"}

    def update_weights(self, info):
        if not self.updating:
            raise RuntimeError("/update_weights outside a weight update (call /start_weight_update first)")
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        received = []
        for dtype, shape in zip(dtypes, shapes):  # all of them first: a bad name must not strand the trainer
            received.append(torch.empty(tuple(shape), dtype=getattr(torch, dtype)))
            self.group.broadcast(received[-1], src=0)
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise KeyError(f"no parameter {unknown[0]!r} in the served model")
        for name, weight in zip(names, received):
            self.params[name].data.copy_(weight)
        self.record("events.jsonl", {"event": "update_weights", "names": names})
        return {"message": "Weights updated"}

    def finish_weight_update(self):
        self.updating = False
        self.dump_weights()
        self.record("events.jsonl", {"event": "finish_weight_update"})
        return {"message": "Weight update finished"}


class VLLMServeStandIn(ProtocolServer):
    """vLLM's `vllm serve` endpoints over `engine` (ProtocolServer's HTTP threads and command queue). A setting left
    out answers as vLLM does: without dev mode its development endpoints are not served (404), without scale-out the
    render / generate pair, without a weight-transfer config `/server_info` shows none."""

    DEV = {"server_info", "get_world_size", "init_weight_transfer_engine", "start_weight_update", "update_weights",
           "finish_weight_update", "reset_prefix_cache"}
    SCALE_OUT = {"v1/chat/completions/render", "inference/v1/generate"}
    POSTS = {"v1/completions": ("completions", "prompt"), "v1/chat/completions/render": ("render", "messages"),
             "inference/v1/generate": ("generate_tokens", "token_ids"),
             "init_weight_transfer_engine": ("init_weight_transfer_engine", "init_info"),
             "update_weights": ("update_weights", "update_info"), "start_weight_update": ("start_weight_update", None),
             "finish_weight_update": ("finish_weight_update", None), "reset_prefix_cache": ("reset_prefix_cache", None)}

    def __init__(self, engine, host, port, *, model_name, dev_mode=True, scale_out=True, weight_transfer="gloo"):
        super().__init__(engine, host, port)
        engine.protocol = "vllm"
        self.model_name, self.dev_mode, self.scale_out, self.weight_transfer = (model_name, dev_mode, scale_out,
                                                                                weight_transfer)

    def handle(self, method, path, body):
        route = path.split("?")[0].strip("/")
        if (route in self.DEV and not self.dev_mode) or (route in self.SCALE_OUT and not self.scale_out):
            return 404, {"detail": "Not Found"}
        if "model" in body and body["model"] != self.model_name:
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist.", "code": 404}}
        if method == "GET" and route == "health":
            return 200, {}
        if method == "GET" and route == "v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        if method == "GET" and route == "get_world_size":
            return 200, {"world_size": self.engine.world_size}
        if method == "GET" and route == "server_info":
            transfer = None if self.weight_transfer == "none" else {"backend": self.weight_transfer}
            return 200, {"vllm_config": {"model_config": {"model": self.model_name,
                                                          "logprobs_mode": self.engine.logprobs_mode},
                                         "weight_transfer_config": transfer}}
        if method != "POST" or route not in self.POSTS:
            return 404, {"detail": "Not Found"}
        try:
            check_request(route, body)
        except BadRequest as err:
            return 400, {"error": {"message": str(err), "type": "BadRequestError", "code": 400}}
        command, field = self.POSTS[route]
        if route in ("init_weight_transfer_engine", "update_weights"):
            body = body[field]
        return 200, self.submit(command, (body,) if field else ())


def check_request(route, body):
    """What vLLM would refuse (a missing or mistyped field), and what it would take but our client must not send
    (a field vLLM drops, sampling left to the model's generation config, a packed transfer), as BadRequest."""
    if route == "v1/completions":
        check_fields("/v1/completions", body, COMPLETION_FIELDS, ("model", "prompt", *SAMPLING_SENT))
        prompts = body["prompt"]
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
            raise BadRequest("/v1/completions: the stand-in takes prompts of token ids (TRL's form: a list of lists)")
        check_sampling("/v1/completions", body)
    elif route == "v1/chat/completions/render":
        check_fields("/v1/chat/completions/render", body, {"model", "messages", "max_tokens", "add_generation_prompt"},
                     ("model", "messages"))
    elif route == "inference/v1/generate":
        check_fields("/inference/v1/generate", body, GENERATE_FIELDS, ("token_ids", "sampling_params"))
        check_fields("/inference/v1/generate sampling_params", body["sampling_params"], SAMPLING_FIELDS,
                     SAMPLING_SENT)
        check_sampling("/inference/v1/generate sampling_params", body["sampling_params"])
    elif route == "init_weight_transfer_engine":
        check_fields("/init_weight_transfer_engine", body, {"init_info"}, ("init_info",))
        check_fields("init_info", body["init_info"], INIT_FIELDS | INIT_OPTIONS, sorted(INIT_FIELDS))
        if body["init_info"].get("packed"):
            raise BadRequest("init_info: packed transfers are not taken by the stand-in (a CPU trainer broadcasts "
                             "tensor by tensor)")
    elif route == "update_weights":
        check_fields("/update_weights", body, {"update_info"}, ("update_info",))
        info = body["update_info"]
        check_fields("update_info", info, UPDATE_FIELDS, ("names", "dtype_names", "shapes"))
        if not len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]):
            raise BadRequest("update_info: names, dtype_names and shapes of different lengths")
        bad = [d for d in info["dtype_names"] if not isinstance(getattr(torch, str(d), None), torch.dtype)]
        if bad:  # vLLM's engine takes getattr(torch, dtype_name)
            raise BadRequest(f"update_info: dtype_names {bad[:3]} are not torch dtype names")
        if info.get("packed"):
            raise BadRequest("update_info: packed transfers are not taken by the stand-in (the client broadcasts "
                             "tensor by tensor)")
    elif route == "start_weight_update":
        check_fields("/start_weight_update", body, START_FIELDS)


SAMPLING_SENT = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed",
                 "logprobs")  # vllm serve fills a field left out from the model's generation config


def check_sampling(what, params):
    bias = params.get("logit_bias") or {}
    if not all(isinstance(k, str) and k.isdigit() and -100 <= float(v) <= 100 for k, v in bias.items()):
        raise BadRequest(f"{what}: logit_bias maps token ids (strings) to biases in [-100, 100]")
    if not (isinstance(params["n"], int) and params["n"] >= 1 and isinstance(params["seed"], int)):
        raise BadRequest(f"{what}: n must be an int >= 1 and seed an int")
    if params["logprobs"] != 0:
        raise BadRequest(f"{what}: logprobs 0 gives the sampled token's log-prob alone")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dump_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocol", choices=("trl", "vllm"), default="trl")
    parser.add_argument("--no_dev_mode", action="store_true")
    parser.add_argument("--no_scale_out", action="store_true")
    parser.add_argument("--weight_transfer", choices=("gloo", "nccl", "none"), default="gloo")
    parser.add_argument("--logprobs_mode", default="processed_logprobs")
    parser.add_argument("--max_pixels", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = HFEngine(args.model, bind_host=args.host, dump_dir=args.dump_dir, seed=args.seed,
                      max_pixels=args.max_pixels, logprobs_mode=args.logprobs_mode)
    if args.protocol == "trl":
        server = ProtocolServer(engine, args.host, args.port)
    else:
        server = VLLMServeStandIn(engine, args.host, args.port, model_name=args.model, dev_mode=not args.no_dev_mode,
                                  scale_out=not args.no_scale_out, weight_transfer=args.weight_transfer)
    print(f"serving on http://{args.host}:{server.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
