"""A fake vLLM module for the tests: what utils/core/vllm_rollout.py uses of `vllm.LLM` and `vllm.SamplingParams`,
recording the calls. Completions follow each request's seed and end at its first stop id; every sampled token
gets the log-prob `FakeLLM.logprob`. Used by tests/test_vllm_rollout.py and by train_grpo's --use_vllm run."""

import json
import os
from types import SimpleNamespace

from safetensors.torch import load_file

DIST_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def request_output(prompt, tokens, logps=None, missing=()):
    entries = None
    if logps is not None:
        entries = [{} if t in missing else {tok: SimpleNamespace(logprob=lp, rank=1)}
                   for t, (tok, lp) in enumerate(zip(tokens, logps))]
    return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[SimpleNamespace(token_ids=list(tokens),
                                                                                   logprobs=entries)])


class FakeEngineModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded += [name for name, _ in weights]


class FakeLLM:
    """What VLLMRollout uses of vllm.LLM, recording the calls; completions follow the request's seed."""

    logprob = -0.5  # vLLM's log-prob of every sampled token

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.model = kwargs, [], FakeEngineModel()
        self.env = {k: os.environ.get(k) for k in DIST_KEYS}
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)),
                                          remove_lora=lambda lora_id: self.calls.append(("remove_lora", lora_id)))
        self.adapters, self.lora_ids = {}, []  # LoRA: what each request's adapter folder held, ids per generate
        FakeVLLM.engines.append(self)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm, lora_request=None):
        self.calls.append(("generate", len(prompts)))
        self.all_params = getattr(self, "all_params", []) + list(params)
        self.lora_ids.append(None if lora_request is None else lora_request.lora_int_id)
        if lora_request is not None and lora_request.lora_int_id not in self.adapters:  # vLLM loads it on first use
            assert self.kwargs.get("enable_lora"), "a LoRA request to an engine built without enable_lora"
            with open(os.path.join(lora_request.lora_path, "adapter_config.json")) as f:
                config = json.load(f)
            assert config["r"] <= self.kwargs["max_lora_rank"], "vLLM refuses an adapter over max_lora_rank"
            tensors = load_file(os.path.join(lora_request.lora_path, "adapter_model.safetensors"))
            self.adapters[lora_request.lora_int_id] = (lora_request.lora_name, config, tensors)
        self.prompts, self.params = prompts, params
        outs = []
        for prompt, p in zip(prompts, params):
            n = 2 + p.seed % 3
            tokens = [20 + (p.seed + t) % 5 for t in range(n)] + [p.stop_token_ids[0]]
            logps = [self.logprob] * len(tokens)
            outs.append(request_output(prompt["prompt_token_ids"], tokens[: p.max_tokens], logps))
        self.outputs = outs
        return outs


class FakeVLLM:
    engines = []
    LLM = FakeLLM
    lora = SimpleNamespace(request=SimpleNamespace(LoRARequest=lambda **kw: SimpleNamespace(**kw)))

    @staticmethod
    def SamplingParams(**kwargs):  # noqa: N802 - the vllm name
        return SimpleNamespace(**kwargs)
