"""What the vLLM engines get of the policy: its trainable weights one tensor at a time under checkpoint names (LoRA
layers merged one at a time into a temporary), or, for --vllm_lora_sync adapter, the LoRA adapter itself in PEFT's
files for a vLLM LoRA request (the language model's LoRA layers; the tower's are merged). docs/distributed.md."""

import contextlib
import json
import math

from utils.core.logprobs import hf_core
from utils.core.models import PROJECTOR_MODULE_NAMES, VISION_MODULE_NAMES


def _lora_layers(core):
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in core.named_modules() if isinstance(m, LoraLayer)}


def _merged_lora_weight(name, layer):
    """base weight + the deltas of the active adapters, in a new tensor (the base weight is not touched)."""
    base = layer.get_base_layer().weight
    if getattr(layer, "merged", False):
        return base.data
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in getattr(layer, "lora_A", {}) and adapter not in getattr(layer, "lora_embedding_A", {}):
            continue
        if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "lora_bias", {}).get(adapter):
            raise ValueError(f"vLLM weight sync: {name} uses a LoRA variant (DoRA, lora_bias...); only plain LoRA "
                             "adapters are merged layer by layer")
        d = layer.get_delta_weight(adapter).float()
        delta = d if delta is None else delta.add_(d)
    return base.data if delta is None else delta.add_(base.data.float()).to(base.dtype)


def iter_sync_weights(model, gather=None, adapter_layers=(), frozen=False):
    """(name, tensor) pairs to load into vLLM, with checkpoint names, one at a time.

    `gather(params)` is a context manager that materialises those parameters (DeepSpeed ZeRO-3's
    `GatheredParameters`; none otherwise): it is entered for one parameter, or for one LoRA layer (its base
    weight and adapters), while its tensor is handed out. Frozen parameters are skipped unless LoRA adapters
    are merged into them or `frozen` asks for every weight; the LoRA layers named in `adapter_layers` are skipped
    (they reach vLLM as an adapter).
    Every process must iterate (under ZeRO-3 each gather is a collective).
    """
    gather = gather or (lambda params: contextlib.nullcontext())
    core = hf_core(model)
    lora = _lora_layers(core) if hasattr(model, "peft_config") else {}
    lora = {name: layer for name, layer in lora.items() if name not in set(adapter_layers)}
    for name, param in core.named_parameters():
        if "lora_" in name or ".original_module." in name:
            continue  # adapters are merged into their layer's weight; the copy modules_to_save replaced
        owner = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        clean = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        if owner in lora and name.endswith(".base_layer.weight"):
            layer = lora[owner]
            with gather(list(layer.parameters())):
                yield clean, _merged_lora_weight(owner, layer)
        elif param.requires_grad or frozen:
            with gather([param]):
                yield clean, param.data


# ----------------------------------------------------------------------------------------------
# LoRA: the adapter itself as a vLLM LoRA request (--vllm_lora_sync adapter)
# ----------------------------------------------------------------------------------------------

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices of max_lora_rank


def vllm_max_lora_rank(r):
    """The smallest max_lora_rank vLLM accepts that holds rank r (None: r is over vLLM's largest)."""
    return next((k for k in VLLM_LORA_RANKS if k >= r), None)


def adapter_layers(model):
    """{name: LoRA layer} that a vLLM adapter can carry: plain LoRA linear layers of the language model. Layers in
    the vision tower or its projector (vLLM applies LoRA to the language model) and embedding LoRA are merged."""
    from peft.tuners.lora import Linear

    outside = set(VISION_MODULE_NAMES) | set(PROJECTOR_MODULE_NAMES)
    out = {}
    for name, layer in _lora_layers(hf_core(model)).items():
        if set(name.split(".")) & outside or not isinstance(layer, Linear):
            continue
        if getattr(layer, "lora_variant", {}) or any(getattr(layer, "lora_bias", {}).values()):
            continue  # DoRA and friends: merged
        out[name] = layer
    return out


def adapter_files(model, layers, gather=None):
    """(adapter_config dict, PEFT-format tensors) of the active adapter on `layers`: what vLLM's LoRA loader reads
    from a folder. Under ZeRO-3 each layer's adapter is gathered on its own."""
    gather = gather or (lambda params: contextlib.nullcontext())
    config = model.peft_config[model.active_adapter]
    tensors = {}
    for name, layer in layers.items():
        adapter = model.active_adapter
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        with gather([a, b]):
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().to("cpu", copy=True).contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().to("cpu", copy=True).contiguous()
    as_json = json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    as_json.update(target_modules=sorted({n.rsplit(".", 1)[-1] for n in layers}), modules_to_save=None,
                   rank_pattern={}, alpha_pattern={})
    return as_json, tensors


def vllm_lora_scaling(adapter_config):
    """The scale vLLM gives B A (its PEFT config reader): alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r
