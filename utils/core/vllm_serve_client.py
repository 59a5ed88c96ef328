"""Server mode's client of vLLM's own `vllm serve`, which TRL 1.16's `trl vllm-serve` runs (VLLM_SERVER_DEV_MODE=1,
`--weight-transfer-config '{"backend": "nccl"}'`, `--logprobs-mode processed_logprobs`, `--enable-scale-out`). The
requests are TRL 1.16's client's (trl/generation/vllm_client.py), one prompt and its n seeded completions each:

    GET  /v1/models                    the served model's name, which every request names
    GET  /server_info?config_format=json   (dev mode) its config: weight_transfer_config, model_config.logprobs_mode
    GET  /get_world_size               (dev mode) {"world_size": W workers}
    POST /v1/completions               prompt [token ids], n, sampling, seed, logprobs=0, return_token_ids -> choices
                                       with token_ids, prompt_token_ids, logprobs.token_logprobs
    POST /v1/chat/completions/render   (scale-out) a prompt's images alone -> "features": processed images, hashes and
                                       placeholder ranges, which are moved onto the image tokens of the trainer's ids
    POST /inference/v1/generate        (scale-out) token ids + features + sampling_params (output_kind 2) -> choices
                                       with token_ids and logprobs.content[].logprob
    POST /init_weight_transfer_engine  {"init_info": {master_address, master_port, rank_offset: 1, world_size: W + 1}}:
                                       the trainer is rank 0 and holds the group's store, worker w joins as rank w + 1;
                                       it answers once the group has formed, so it is sent beside the trainer's join
    POST /start_weight_update, POST /update_weights {"update_info": {names, dtype_names, shapes}} (the reply comes
                                       once the workers received every tensor, in that order); /finish_weight_update
    POST /reset_prefix_cache           (dev mode)

On a GPU the group and the broadcasts are vLLM's own (utils.core.vllm_group.vllm_nccl_transfer: NCCL, packed, as TRL
1.16 sends them); a trainer on the CPU joins over gloo and sends tensor by tensor, against a server whose
weight_transfer_config names the backend "gloo" (the tests' stand-in). A server missing a setting is refused in one
line naming what to restart it with. docs/distributed.md.
"""

import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from utils.core.vllm_client import (
    CONCURRENCY,
    ServerClient,
    ServerError,
    as_float,
    beside,
    encode_image,
    local_address,
    prompt_runs,
)
from utils.core.vllm_group import GlooGroup, vllm_nccl_transfer

REFUSAL_WAIT = 0.2  # seconds the trainer waits for /update_weights to refuse its announcement before it broadcasts
SUPPRESS_BIAS = -100.0  # the logit bias of a suppressed token (OpenAI's bound; JSON has no -inf)
# what a `vllm serve` started without a setting answers, and the setting
DEV_MODE = "restart it with VLLM_SERVER_DEV_MODE=1 in its environment (its weight-transfer and cache endpoints)"
SCALE_OUT = ("restart it with --enable-scale-out (vLLM 0.30 and later; image prompts go through "
             "/v1/chat/completions/render and /inference/v1/generate)")
WEIGHT_TRANSFER = """restart it with --weight-transfer-config '{"backend": "nccl"}'"""


def broadcast_each(weights, group):
    """The CPU trainer's transfer: each (name, tensor) broadcast from rank 0 on its own (vLLM's unpacked one)."""
    for _, tensor in weights:
        group.broadcast(tensor, src=0)


def vllm_sampling_params(sampling, *, n, seed):
    """vLLM's sampling parameters of one request: `round_sampling` for n completions from `seed` (vLLM gives the
    k-th of them seed + k), the suppressed tokens at `SUPPRESS_BIAS`, the sampled tokens' log-probs."""
    bias = {str(i): SUPPRESS_BIAS for i in sampling["suppress_ids"]}
    return dict(n=int(n), temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"],
                min_p=0.0, repetition_penalty=1.0, max_tokens=sampling["max_tokens"],
                stop_token_ids=sampling["stop_token_ids"], logit_bias=bias or None, logprobs=0,
                seed=int(seed) & 0x7FFFFFFF)


def completion_body(model, ids, params):
    """/v1/completions of one text prompt as token ids (TRL's request), with the ids of prompt and completion back."""
    return {"model": model, "prompt": [list(ids)], "return_token_ids": True, "return_tokens_as_token_ids": True,
            **params}


def generate_body(model, ids, features, params):
    """/inference/v1/generate of one prompt's token ids and its images' features. FINAL_ONLY (output_kind 2): without
    it the endpoint answers with the last finished of the n sequences only."""
    return {"request_id": f"mmgrpo-{uuid.uuid4().hex}", "model": model, "token_ids": list(ids), "features": features,
            "sampling_params": {**params, "output_kind": 2}}


def image_token_runs(ids, image_token_id):
    """[(offset, length)] of each run of `image_token_id` in `ids`."""
    runs, k = [], 0
    while k < len(ids):
        if ids[k] == image_token_id:
            start = k
            while k < len(ids) and ids[k] == image_token_id:
                k += 1
            runs.append((start, k - start))
        else:
            k += 1
    return runs


def place_features(features, ids, image_token_id, prompt=0):
    """The server's features of a prompt's images (rendered on their own) with their placeholders moved onto the
    runs of image tokens in the trainer's prompt ids; each run must be as long as the server made that image."""
    served = [p["length"] for p in features["mm_placeholders"]["image"]]
    runs = image_token_runs(ids, image_token_id)
    if served != [length for _, length in runs]:
        raise ServerError(
            f"the vLLM server turned the images of prompt {prompt} into {served} placeholder tokens where the "
            f"trainer's prompt has runs of {[length for _, length in runs]}: start the server with the trainer's pixel "
            """budget (--mm-processor-kwargs '{"max_pixels": ...}'), or the model's placeholders are not one run """
            "of image tokens per image")
    placed = [{"offset": offset, "length": length} for offset, length in runs]
    return {**features, "mm_placeholders": {**features["mm_placeholders"], "image": placed}}


def choice_logprobs(choice):
    """The sampled tokens' log-probs of one choice (NaN where missing), or None: /v1/completions gives
    `token_logprobs`, /inference/v1/generate chat-style `content` entries."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return None
    if "content" in logprobs:
        return [as_float(entry.get("logprob")) for entry in logprobs["content"] or ()]
    return [as_float(value) for value in logprobs.get("token_logprobs") or ()]


class VLLMServeClient(ServerClient):
    """vLLM's `vllm serve` in dev mode with a weight-transfer engine (TRL 1.16's `trl vllm-serve`): concurrent
    requests, one per prompt and its n completions (seeded); every weight pushed through the weight-transfer engine
    after each optimizer step, the trainer the group's rank 0. The server's settings are read (and refused with the
    flag to restart it with) when the client is made."""

    protocol = "vllm"
    sends_frozen = True  # vLLM reloads whole layers between start and finish (TRL sends every weight too)

    def __init__(self, base_url, **kwargs):
        super().__init__(base_url, **kwargs)
        self.model = self._request("GET", "v1/models")["data"][0]["id"]
        config = self._request("GET", "server_info", params={"config_format": "json"}, missing=DEV_MODE)
        config = config.get("vllm_config") or {}
        self.backend = (config.get("weight_transfer_config") or {}).get("backend")
        self.logprobs_mode = (config.get("model_config") or {}).get("logprobs_mode")
        self.workers = self.world_size()

    def world_size(self) -> int:
        return int(self._request("GET", "get_world_size", missing=DEV_MODE)["world_size"])

    # -- generation --------------------------------------------------------------------------

    def image_features(self, images):
        """The server's features of a prompt's images (TRL's render of the images alone)."""
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encode_image(image)}"}}
                   for image in images]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        return self._request("POST", "v1/chat/completions/render", body, missing=SCALE_OUT)["features"]

    def complete(self, ids, images, params, image_token_id=None, prompt=0):
        """(echoed prompt ids, choices) of one prompt: /v1/completions for token ids alone, the features path with
        images."""
        if not images:
            choices = self._request("POST", "v1/completions", completion_body(self.model, ids, params))["choices"]
        else:
            if image_token_id is None:
                raise ServerError("image prompts need the processor's image token id (the placeholders' positions)")
            features = place_features(self.image_features(images), ids, image_token_id, prompt)
            choices = self._request("POST", "inference/v1/generate", generate_body(self.model, ids, features, params),
                                    missing=SCALE_OUT)["choices"]
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        if len(choices) != params["n"] or any(c.get("token_ids") is None for c in choices):
            raise ServerError(f"the vLLM server answered prompt {prompt} with {len(choices)} completions (token ids "
                              f"{'missing' if choices and choices[0].get('token_ids') is None else 'given'}) for "
                              f"n = {params['n']}")
        return [c.get("prompt_token_ids") or list(ids) for c in choices], choices

    def sample(self, entries, sampling, image_token_id=None):
        """(prompt ids the server echoed, completion ids, sampled log-probs or None) of each entry (prompt ids, images,
        seed): one request per run of a prompt's completions, n = the run's length, seeded with its first entry's
        seed; up to CONCURRENCY requests at once."""
        runs = prompt_runs(entries)

        def one(k):
            ids, images, count, first = runs[k]
            params = vllm_sampling_params(sampling, n=count, seed=entries[first][2])
            return self.complete(ids, images, params, image_token_id, prompt=first)

        with ThreadPoolExecutor(max_workers=min(CONCURRENCY, len(runs))) as pool:
            answers = list(pool.map(one, range(len(runs))))
        echoed = [echo for echoes, _ in answers for echo in echoes]
        choices = [choice for _, group in answers for choice in group]
        logps = [choice_logprobs(c) for c in choices]
        return echoed, [list(c["token_ids"]) for c in choices], (None if None in logps else logps)

    # -- weights -----------------------------------------------------------------------------

    def init_weight_sync(self, device):
        """Form the weight-transfer group: the trainer rank 0 (holding the store, on this machine's address toward the
        server), the server's W workers ranks 1..W. A GPU trainer joins through vLLM's NCCL engine as TRL 1.16 does
        (packed broadcasts); a CPU one over gloo, tensor by tensor (a server whose backend is "gloo": the tests'
        stand-in)."""
        device = torch.device(device)
        if self.backend is None:
            raise ServerError(f"vLLM server {self.base_url} has no weight-transfer engine: {WEIGHT_TRANSFER}")
        wanted = "nccl" if device.type == "cuda" else "gloo"
        if self.backend != wanted:
            raise ServerError(
                f"vLLM server {self.base_url}: its weight-transfer backend is {self.backend!r} and a trainer on "
                f"{device.type} needs {wanted!r}" + (": run the trainer's main process on a GPU" if wanted == "gloo"
                                                     else f": {WEIGHT_TRANSFER}"))
        address, world = local_address(self.host), self.workers + 1
        init_info = dict(master_address=address, master_port=self.group_port, rank_offset=1, world_size=world)
        if device.type == "cuda":
            open_group, self.send, extra, self.update_extra = vllm_nccl_transfer()
            init_info.update(extra)
            if device.index is not None:
                torch.cuda.set_device(device)  # vLLM opens the trainer's side on the current device
        else:
            self.send, self.update_extra = broadcast_each, {}

            def open_group(info):
                return GlooGroup(info["master_address"], info["master_port"], 0, info["world_size"])

        def join(reply):  # the server answers once the group has formed
            self.group = open_group(init_info)

        beside(lambda: self._request("POST", "init_weight_transfer_engine", {"init_info": init_info},
                                     missing=DEV_MODE, retries=0), join)

    def push_weights(self, metadata, weights):
        """One weight update: /start_weight_update, then /update_weights announcing every tensor of `metadata`
        [(name, dtype name, shape)] while `weights` [(name, tensor)] in that order are broadcast from rank 0 (its
        reply comes once the workers have them all), /finish_weight_update, /reset_prefix_cache."""
        names, dtypes, shapes = (list(field) for field in zip(*metadata))
        self._request("POST", "start_weight_update", {}, missing=DEV_MODE, retries=0)
        info = {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes, **self.update_extra}}

        def announced(reply):  # `weights`, checked against what /update_weights announced
            try:  # a refused announcement answers at once: raise it before a broadcast nobody would receive
                reply.result(timeout=REFUSAL_WAIT)
            except TimeoutError:
                pass  # the workers are receiving
            sent = 0
            for name, tensor in weights:
                if sent >= len(names) or name != names[sent] or list(tensor.shape) != list(shapes[sent]):
                    raise RuntimeError(f"weight sync: {name} {list(tensor.shape)} is not the announced tensor "
                                       f"{sent} of {len(names)}")
                if reply.done():  # a refused update: stop before a broadcast that nobody receives
                    reply.result()
                yield name, tensor.detach().contiguous()
                sent += 1
            if sent != len(names):
                raise RuntimeError(f"weight sync: {sent} tensors sent of the {len(names)} announced")

        # the server answers once its workers received every tensor
        beside(lambda: self._request("POST", "update_weights", info, retries=0),
               lambda reply: self.send(announced(reply), self.group))
        self._request("POST", "finish_weight_update", {}, retries=0)
        self.reset_prefix_cache()

    def reset_prefix_cache(self):
        self._request("POST", "reset_prefix_cache", missing=DEV_MODE, retries=0)
