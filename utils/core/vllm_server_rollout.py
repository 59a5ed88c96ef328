"""Server mode (`--vllm_mode server`): rollouts from one generation server for every process (TRL's
`vllm_mode="server"`; the protocol is utils/core/vllm_client.py, the server vllm_serve.py). The main process asks for
a round's completions in one request and pushes the policy's weights after every optimizer step. docs/distributed.md.
"""

import math

import torch

from utils.core.config import ConfigError
from utils.core.fsdp import fsdp2_unsharded
from utils.core.importance import importance_weights
from utils.core.vllm_client import VLLMClient, server_base_url
from utils.core.vllm_flags import flag
from utils.core.vllm_rollout import VLLMRollout, on_device, pack_completions, request_inputs
from utils.core.vllm_weights import iter_sync_weights
from utils.core.zero3 import parameter_gatherer


def server_sampling(cfg, *, stop_ids, suppress_ids, vocab_size):
    """The /generate/ arguments of one round, the same sampling as the HF path: the suppressed tokens are left out of
    `allowed_token_ids` (logit_bias's keys would reach the server as JSON strings), the stop ids are sent as such."""
    extra = {"stop_token_ids": sorted(int(i) for i in stop_ids)}
    if suppress_ids:
        suppressed = {int(i) for i in suppress_ids}
        extra["allowed_token_ids"] = [i for i in range(int(vocab_size)) if i not in suppressed]
    return dict(temperature=cfg.temperature, top_p=getattr(cfg, "top_p", 1.0), top_k=getattr(cfg, "top_k", None) or 0,
                min_p=0.0, repetition_penalty=1.0, max_tokens=cfg.max_completion_length, logprobs=0,
                generation_kwargs=extra)


def group_requests(entries):
    """(prompts, images, n) of one /generate/ request for `entries` [(prompt ids, images)], one per completion in
    order: consecutive equal entries are one prompt asked for several completions; n is the largest count that
    divides every run, so the n completions of each prompt come back in the entries' order."""
    runs = []
    for ids, images in entries:
        if runs and runs[-1][0] == ids and runs[-1][1] == images:
            runs[-1][2] += 1
        else:
            runs.append([ids, images, 1])
    n = math.gcd(*[count for _, _, count in runs])
    prompts = [(ids, images) for ids, images, count in runs for _ in range(count // n)]
    return [p for p, _ in prompts], [i for _, i in prompts], n


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
            seq.append(math.nan if value is None else float(value))
        out.append(seq + [math.nan] * (len(row) - len(seq)))
    return out


class VLLMServerRollout:
    """Rollouts from a generation server (TRL's `vllm_mode="server"`). Every process gathers its prompts to the main
    process, which sends one /generate/ request and hands each process its completions back; the main process also
    pushes the policy's weights through the weight-update group (all processes take part under ZeRO-3, whose gathers
    are collective), after every optimizer step (`sync_after_step`) and before the first round. `client` is
    injectable for tests."""

    def __init__(self, accelerator, cfg, *, model_config, client=None):
        self.accelerator, self.cfg = accelerator, cfg
        mode = flag(cfg, "vllm_importance_sampling_mode")
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode=mode,
                           cap=flag(cfg, "vllm_importance_sampling_cap"))
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.vocab_size = int(text_config.vocab_size)
        self.client, self._synced_step, self._warned = None, None, False
        if accelerator.is_main_process:
            self.client = client or VLLMClient(
                server_base_url(flag(cfg, "vllm_server_base_url"), flag(cfg, "vllm_server_host"),
                                flag(cfg, "vllm_server_port")),
                group_port=flag(cfg, "vllm_group_port"), connection_timeout=flag(cfg, "vllm_server_timeout"))
            self.client.init_communicator(accelerator.device)
        accelerator.wait_for_everyone()

    def sleep(self):
        """Nothing to free: the engine is on the server's GPUs."""

    @torch.no_grad()
    def sync_weights(self, policy):
        """Push the policy's trainable (LoRA: merged layer by layer) weights to the server, one tensor at a time."""
        wrapper = self.accelerator.unwrap_model(policy)
        with fsdp2_unsharded(wrapper):  # FSDP2: whole weights while they are read (a no-op otherwise)
            for name, tensor in iter_sync_weights(wrapper.model, parameter_gatherer(self.accelerator, policy)):
                if self.client is not None:
                    self.client.update_named_param(name, tensor)
        if self.client is not None:
            self.client.reset_prefix_cache()  # also reports a failed update (an unknown name, a shape mismatch)

    def sync_after_step(self, policy, step):
        """After optimizer step `step`: the server gets the new weights now (every process calls this)."""
        self.sync_weights(policy)
        self._synced_step = step

    def generate(self, policy, processor, messages, images, seeds, *, step, stop_ids, suppress_ids=None,
                 prompt_batch=None, prompt_index=None, return_logprobs=False, videos=None):
        """As `VLLMRollout.generate`; the server samples (its own seeds: `seeds` are not sent)."""
        from accelerate.utils import broadcast_object_list, gather_object

        if videos and any(videos):
            raise ValueError("--vllm_mode server sends images only (TRL's protocol has no videos); use colocate mode")
        tokenizer, suppress_ids, sent = request_inputs(self, policy, processor, messages, images, seeds, step=step,
                                                       stop_ids=stop_ids, suppress_ids=suppress_ids,
                                                       prompt_batch=prompt_batch, prompt_index=prompt_index)
        local = [(list(ids), list(imgs)) for ids, imgs in zip(sent, images)]
        everyone = gather_object([local]) if self.accelerator.num_processes > 1 else [local]
        payload = [None]
        if self.client is not None:
            prompts, prompt_images, n = group_requests([entry for part in everyone for entry in part])
            response = self.client.generate(
                prompts, prompt_images if any(prompt_images) else None, n=n,
                **server_sampling(self.cfg, stop_ids=stop_ids, suppress_ids=suppress_ids, vocab_size=self.vocab_size))
            if len(response["completion_ids"]) != len(prompts) * n or len(response["prompt_ids"]) != len(prompts):
                raise RuntimeError(f"the vLLM server returned {len(response['completion_ids'])} completions of "
                                   f"{len(response['prompt_ids'])} prompts for {len(prompts)} prompts x {n}")
            rows = response["completion_ids"]
            payload = [([p for p in response["prompt_ids"] for _ in range(n)], rows, sampled_logprobs(response, rows))]
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
            raise ConfigError("--vllm_mode server: the data set has videos, and the server protocol (TRL's) sends "
                              "images only; use colocated engines (--vllm_mode colocate)")
        return VLLMServerRollout(accelerator, cfg, model_config=model_config)
    return VLLMRollout(model_path, accelerator, cfg, processor=processor, model_config=model_config, **kwargs)
