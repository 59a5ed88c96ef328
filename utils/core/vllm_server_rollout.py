"""Server mode (`--vllm_mode server`): rollouts from one generation server for every process (TRL's
`vllm_mode="server"`): vLLM's `vllm serve` (what TRL 1.16's `trl vllm-serve` runs; utils/core/vllm_serve_client.py) or
a server of the older `trl vllm-serve` protocol (vllm_serve.py; utils/core/vllm_client.py), told apart by `connect`.
The main process asks for a round's completions and pushes the policy's weights after every optimizer step.
docs/distributed.md.
"""

import torch

from utils.core.config import ConfigError
from utils.core.fsdp import fsdp2_unsharded
from utils.core.http import HTTPFailure
from utils.core.http import request as http_request
from utils.core.importance import importance_weights
from utils.core.models import image_token_id
from utils.core.vllm_client import (
    ServerClient,
    ServerError,
    VLLMClient,
    round_sampling,
    server_base_url,
    wait_for_server,
)
from utils.core.vllm_flags import flag
from utils.core.vllm_rollout import VLLMRollout, on_device, pack_completions, request_inputs
from utils.core.vllm_serve_client import VLLMServeClient
from utils.core.vllm_weights import iter_sync_weights
from utils.core.zero3 import parameter_gatherer


def connect(base_url: str, *, group_port: int = 51216, connection_timeout: float = 240.0,
            request_timeout: float | None = None) -> ServerClient:
    """The client of the server at `base_url`, once it answers: VLLMServeClient for vLLM's `vllm serve` (it lists
    its models at /v1/models), VLLMClient for the older `trl vllm-serve` protocol (vllm_serve.py)."""
    base_url = base_url.rstrip("/")
    headers = wait_for_server(base_url, connection_timeout)
    try:
        models = http_request("GET", f"{base_url}/v1/models", what="vLLM server", timeout=30.0, max_retries=1)
        openai = models.status == 200 and bool(models.json().get("data"))
    except (HTTPFailure, ValueError):
        openai = False
    client = (VLLMServeClient if openai else VLLMClient)(base_url, group_port=group_port,
                                                          request_timeout=request_timeout)
    client.host = headers.get("X-Forwarded-For", client.host)
    return client


class VLLMServerRollout:
    """Rollouts from a generation server (TRL's `vllm_mode="server"`). Every process gathers its prompts to the main
    process, which asks the server (`client.sample`) and hands each process its completions back; the main process
    also pushes the policy's weights (all processes walk them: ZeRO-3's gathers are collective), after every
    optimizer step (`sync_after_step`) and before the first round. `client` is injectable for tests."""

    def __init__(self, accelerator, cfg, *, model_config, processor=None, client=None):
        from accelerate.utils import broadcast_object_list

        self.accelerator, self.cfg = accelerator, cfg
        mode = flag(cfg, "vllm_importance_sampling_mode")
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode=mode,
                           cap=flag(cfg, "vllm_importance_sampling_cap"))
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.vocab_size = int(text_config.vocab_size)
        self.image_token_id = image_token_id(processor) if processor is not None else None
        self.client, self.metadata, self._synced_step, self._warned = None, None, None, False
        sends_frozen = [False]
        if accelerator.is_main_process:
            self.client = client or connect(
                server_base_url(flag(cfg, "vllm_server_base_url"), flag(cfg, "vllm_server_host"),
                                flag(cfg, "vllm_server_port")),
                group_port=flag(cfg, "vllm_group_port"), connection_timeout=flag(cfg, "vllm_server_timeout"))
            mode = getattr(self.client, "logprobs_mode", None)
            if mode not in (None, "processed_logprobs") and flag(cfg, "vllm_importance_sampling_correction"):
                raise ServerError(f"vLLM server {self.client.base_url} returns {mode}, and the importance-sampling "
                                  "correction compares the log-probs sampled from (after temperature): restart it "
                                  "with --logprobs-mode processed_logprobs")
            self.client.init_weight_sync(accelerator.device)
            sends_frozen = [self.client.sends_frozen]
        if accelerator.num_processes > 1:
            broadcast_object_list(sends_frozen, from_process=0)
        self.sends_frozen = sends_frozen[0]  # vllm serve: every weight, as TRL sends; the older protocol: trainable
        accelerator.wait_for_everyone()

    def sleep(self):
        """Nothing to free: the engine is on the server's GPUs."""

    @torch.no_grad()
    def sync_weights(self, policy):
        """Push the policy's weights to the server (LoRA: merged layer by layer), one tensor at a time. vLLM's update
        announces every tensor first: their names, dtypes and shapes come from one walk at the first sync."""
        wrapper = self.accelerator.unwrap_model(policy)
        with fsdp2_unsharded(wrapper):  # FSDP2: whole weights while they are read (a no-op otherwise)
            gather = parameter_gatherer(self.accelerator, policy)

            def weights():
                return iter_sync_weights(wrapper.model, gather, frozen=self.sends_frozen)

            if self.sends_frozen and self.metadata is None:
                self.metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in weights()]
            if self.client is not None:
                self.client.push_weights(self.metadata, weights())
            else:
                for _ in weights():  # every process walks the weights: ZeRO-3's gathers are collective
                    pass

    def sync_after_step(self, policy, step):
        """After optimizer step `step`: the server gets the new weights now (every process calls this)."""
        self.sync_weights(policy)
        self._synced_step = step

    def generate(self, policy, processor, messages, images, seeds, *, step, stop_ids, suppress_ids=None,
                 prompt_batch=None, prompt_index=None, return_logprobs=False, videos=None):
        """As `VLLMRollout.generate`. `vllm serve` samples each prompt's completions from its first completion's seed
        (vLLM gives the k-th seed + k); the older protocol takes no seeds."""
        from accelerate.utils import broadcast_object_list, gather_object

        if videos and any(videos):
            raise ValueError("--vllm_mode server sends images only (no video path in either protocol); use colocate "
                             "mode")
        tokenizer, suppress_ids, sent = request_inputs(self, policy, processor, messages, images, seeds, step=step,
                                                       stop_ids=stop_ids, suppress_ids=suppress_ids,
                                                       prompt_batch=prompt_batch, prompt_index=prompt_index)
        seeds = seeds.tolist() if torch.is_tensor(seeds) else list(seeds)
        local = [(list(ids), list(imgs), int(seed)) for ids, imgs, seed in zip(sent, images, seeds)]
        everyone = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
        payload = [None]
        if self.client is not None:
            sampling = round_sampling(self.cfg, stop_ids=stop_ids, suppress_ids=suppress_ids,
                                      vocab_size=self.vocab_size)
            payload = [self.client.sample([entry for part in everyone for entry in part], sampling,
                                          image_token_id=self.image_token_id)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        echoed, rows, logps = payload[0]
        start = sum(len(part) for part in everyone[:self.accelerator.process_index])
        mine = slice(start, start + len(local))
        ids, mask, logps = pack_completions(rows[mine], None if logps is None else logps[mine], echoed[mine], sent,
                                            pad_token_id=tokenizer.pad_token_id, stop_ids=stop_ids,
                                            where="the vLLM server")
        if logps is None and return_logprobs:  # a server that sends no log-probs: no importance-sampling correction
            if not self._warned:
                self.accelerator.print("the vLLM server sent no log-probs of the sampled tokens: training without "
                                       "the importance-sampling correction (--vllm_importance_sampling_correction)")
                self._warned = True
            return ids.to(self.accelerator.device), mask.to(self.accelerator.device), None
        return on_device(ids, mask, logps, self.accelerator.device, return_logprobs)


def make_vllm_rollout(model_path, accelerator, cfg, *, processor=None, model_config=None, **kwargs):
    """The rollout engine of --use_vllm: a colocated engine per process, or the server of --vllm_mode server."""
    if flag(cfg, "vllm_mode") == "server":
        if kwargs.get("max_videos_per_prompt"):
            raise ConfigError("--vllm_mode server: the data set has videos, and server mode sends images only; use "
                              "colocated engines (--vllm_mode colocate)")
        return VLLMServerRollout(accelerator, cfg, model_config=model_config, processor=processor)
    return VLLMRollout(model_path, accelerator, cfg, processor=processor, model_config=model_config, **kwargs)
