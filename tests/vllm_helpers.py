"""A fake vLLM module for the tests: what utils/core/vllm_rollout.py uses of `vllm.LLM` and `vllm.SamplingParams`,
recording the calls. Completions follow each request's seed and end at its first stop id; every sampled token
gets the log-prob `FakeLLM.logprob`. Used by tests/test_vllm_rollout.py and by train_grpo's --use_vllm run."""

import os
from types import SimpleNamespace

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
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))
        FakeVLLM.engines.append(self)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", len(prompts)))
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

    @staticmethod
    def SamplingParams(**kwargs):  # noqa: N802 - the vllm name
        return SimpleNamespace(**kwargs)
