"""The vLLM flags of `train_grpo.py --use_vllm` (docs/distributed.md): their defaults, read with `flag(cfg, name)` so
any script's config works, and the checks that refuse a combination before a model loads, each naming the flag and
why (colocated-engine flags in server mode name the vllm_serve.py flag that sets them there)."""

import torch

from utils.core.config import ConfigError
from utils.core.vllm_weights import VLLM_LORA_RANKS, vllm_max_lora_rank

FLAG_DEFAULTS = {
    "vllm_mode": "colocate",  # colocate: an engine in every training process; server: a server on other GPUs
    "vllm_server_base_url": None,  # server mode: the server's URL; none: http://host:port
    "vllm_server_host": "0.0.0.0",  # server mode: the server's host (TRL's default)
    "vllm_server_port": 8000,  # server mode: the server's HTTP port
    "vllm_server_timeout": 240.0,  # server mode: seconds to wait for the server to answer /health
    "vllm_group_port": 51216,  # server mode: the weight-update group's store (on the trainer for vllm serve)
    "vllm_tensor_parallel_size": 1,  # colocate mode: GPUs (processes) each engine is sharded over
    "vllm_model_impl": "vllm",  # colocate mode: vLLM's own model code, or transformers'
    "vllm_lora_sync": "auto",  # LoRA: adapter (vLLM LoRA requests), merge (layers merged into the base), auto
    "vllm_gpu_memory_utilization": 0.3,  # share of the GPU's memory vLLM may take (weights, activations, KV)
    "vllm_max_num_seqs": None,  # most sequences per engine step; none: vLLM's default
    "vllm_max_num_batched_tokens": 4096,  # tokens per engine step (TRL's value: vLLM's profiler misjudges more)
    "vllm_max_model_len": None,  # context window; none: --max_prompt_length + --max_completion_length
    "vllm_enable_sleep_mode": False,  # free the engine's memory between generation rounds (sleep level 2)
    "vllm_enforce_eager": False,  # no CUDA graphs (faster start, slower decoding)
    "vllm_importance_sampling_correction": True,  # correct the sampler/trainer mismatch (on in TRL)
    "vllm_importance_sampling_mode": "token_truncate",  # token or sequence ratio; truncate (cap) or mask (drop)
    "vllm_importance_sampling_cap": 3.0,  # C: weights above it are cut to C (truncate) or to 0 (mask); TRL: 3
}


VLLM_MODES = ("colocate", "server")
# what a colocated engine is built with, and the flags that set it on a server: vllm_serve.py's, `vllm serve`'s
COLOCATE_ONLY = {"vllm_tensor_parallel_size": ("--tensor_parallel_size", "--tensor-parallel-size"),
                 "vllm_gpu_memory_utilization": ("--gpu_memory_utilization", "--gpu-memory-utilization"),
                 "vllm_max_model_len": ("--max_model_len", "--max-model-len"),
                 "vllm_max_model_length": ("--max_model_len", "--max-model-len"),
                 "vllm_enforce_eager": ("--enforce_eager", "--enforce-eager"),
                 "vllm_model_impl": ("--vllm_model_impl", "--model-impl"), "vllm_enable_sleep_mode": (None, None),
                 "vllm_max_num_seqs": (None, "--max-num-seqs"),
                 "vllm_max_num_batched_tokens": (None, "--max-num-batched-tokens")}
SERVER_ONLY = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port")


def flag(cfg, name):
    return getattr(cfg, name, FLAG_DEFAULTS.get(name))


def check_vllm_flags(cfg, num_processes):
    """The vLLM mode and its flags, before any model loads: each refusal names the flag and why. Returns whether this
    process needs vLLM itself (colocated engines; a server's NCCL group on a GPU), for `require_vllm`."""
    mode = flag(cfg, "vllm_mode")
    if mode not in VLLM_MODES:
        raise ConfigError(f"--vllm_mode {mode!r} is not one of {', '.join(VLLM_MODES)}")
    tp = flag(cfg, "vllm_tensor_parallel_size")
    if tp < 1:
        raise ConfigError(f"--vllm_tensor_parallel_size {tp} must be >= 1")
    length, trl_length = flag(cfg, "vllm_max_model_len"), getattr(cfg, "vllm_max_model_length", None)
    if trl_length is not None and trl_length < 1:
        raise ConfigError(f"--vllm_max_model_length {trl_length} must be >= 1 or none")
    if length is not None and trl_length is not None and length != trl_length:
        raise ConfigError(f"--vllm_max_model_length {trl_length} and --vllm_max_model_len {length} disagree (TRL's "
                          "name and ours for one setting): give one")
    for name in ("vllm_server_port", "vllm_group_port"):
        if not 0 < flag(cfg, name) < 65536:
            raise ConfigError(f"--{name} {flag(cfg, name)} is not a TCP port")
    if not flag(cfg, "vllm_server_timeout") > 0:
        raise ConfigError(f"--vllm_server_timeout {flag(cfg, 'vllm_server_timeout')} must be > 0 seconds")
    if getattr(cfg, "vllm_structured_outputs_regex", None) is not None:
        raise ConfigError("--vllm_structured_outputs_regex constrains vLLM's sampling, and the training log-probs "
                          "would not apply the constraint (off-policy updates): drop it")
    lora_sync = flag(cfg, "vllm_lora_sync")
    if lora_sync not in ("auto", "adapter", "merge"):
        raise ConfigError(f"--vllm_lora_sync {lora_sync!r} is not one of auto, adapter, merge")
    if lora_sync == "adapter":
        if not getattr(cfg, "use_peft", False):
            raise ConfigError("--vllm_lora_sync adapter sends the LoRA adapter, and without --use_peft there is none")
        if mode == "server":
            raise ConfigError("--vllm_lora_sync adapter: a server's weight updates take weights, not adapters; "
                              "a server gets the adapted layers merged (--vllm_lora_sync merge or auto)")
        if vllm_max_lora_rank(cfg.lora_r) is None:
            raise ConfigError(f"--vllm_lora_sync adapter: --lora_r {cfg.lora_r} is over vLLM's largest LoRA rank "
                              f"{VLLM_LORA_RANKS[-1]}; use --vllm_lora_sync merge")
    if not cfg.use_vllm:
        if mode == "server":
            raise ConfigError("--vllm_mode server needs --use_vllm (the mode says where vLLM generates)")
        return False
    if mode == "server":
        for name, (ours, vllms) in COLOCATE_ONLY.items():
            if flag(cfg, name) != FLAG_DEFAULTS.get(name):
                starts = [f"python vllm_serve.py {ours}" if ours else None, f"vllm serve {vllms}" if vllms else None]
                where = (f"start the server with {' or '.join(s for s in starts if s)}" if any(starts) else
                         "the server's engine is set up when the server starts")
                raise ConfigError(f"--{name} sets up a colocated engine and does not apply to --vllm_mode server: "
                                  f"{where}")
        if getattr(cfg, "tools", None) and num_processes > 1:
            raise ConfigError("--tools with --vllm_mode server on several processes: a server round is one request "
                              "gathered from every process, and the tool loop's turns differ per process; use "
                              "colocated engines or one process")
        return torch.cuda.is_available()  # the weight-update group on GPUs is vLLM's (NCCL); gloo on the CPU
    changed = [name for name in SERVER_ONLY if flag(cfg, name) != FLAG_DEFAULTS[name]]
    if changed:
        raise ConfigError(f"--{changed[0]} is a setting of --vllm_mode server; with colocated engines it would be "
                          "ignored (add --vllm_mode server, or drop it)")
    if num_processes % tp:
        raise ConfigError(f"--vllm_tensor_parallel_size {tp} must divide the {num_processes} training processes "
                          "(each engine spans that many consecutive ones)")
    return True


def lora_sync_mode(cfg):
    """'adapter' or 'merge' (or None without LoRA), from --vllm_lora_sync: auto is adapter in colocate mode where
    vLLM holds the rank, merge otherwise (a server takes merged weights: neither protocol's update takes adapters)."""
    if not getattr(cfg, "use_peft", False):
        return None
    choice = flag(cfg, "vllm_lora_sync")
    if choice != "auto":
        return choice
    fits = vllm_max_lora_rank(cfg.lora_r) is not None
    return "adapter" if flag(cfg, "vllm_mode") == "colocate" and fits else "merge"
