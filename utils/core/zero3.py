"""ZeRO-3 around the training scripts' hand-written loops: gathering a sharded model's weights (whole, for
generation; one parameter at a time, for the vLLM weight sync), and a gradient fix applied before each optimizer
step's first backward.

The gradient fix: DeepSpeed 0.19.8's stage 3 keeps every gradient partition in one flat buffer and, at the first
micro-step of an optimizer step, copies into it only the gradients that the backward produced (`stage3.py`,
`partition_grads`: `if self.micro_step_id == 0: grad_buffer.copy_(grad_partition)`). A trainable parameter that
gets no gradient in a step keeps the previous step's gradient there, and the optimizer applies it again. That
happens whenever the parameters a step uses change from step to step: the vision tower on a text-only batch, or
on Mix-GRPO's reason steps (the VLM sees no image) after a reflect step (it does). ZeRO-2 and DDP give such a
parameter no gradient; zeroing the buffer first does the same under ZeRO-3."""

import contextlib

from utils.core.fsdp import fsdp2_unsharded


def is_zero3(accelerator, model=None):
    """True when `model` (the prepared model) is a DeepSpeed engine sharded with ZeRO stage 3; without a model
    (before `accelerator.prepare`), when the run's DeepSpeed config asks for stage 3. The one ZeRO-3 test of the
    train scripts."""
    if accelerator.distributed_type.name != "DEEPSPEED":
        return False
    if model is None:
        return accelerator.state.deepspeed_plugin.zero_stage == 3
    return model.zero_optimization_stage() == 3


@contextlib.contextmanager
def zero3_gathered(engine):
    """Gather every ZeRO-3 shard of a DeepSpeed engine once, with the per-module hooks off.

    Under ZeRO-3 each forward would otherwise all-gather every layer again for every new token;
    gathering once makes generation as fast as on an unsharded model (at the memory of one full copy).
    """
    import deepspeed

    opt = engine.optimizer
    offload = opt.parameter_offload if hasattr(opt, "parameter_offload") else opt
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield engine.module
        finally:
            offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def unwrap_for_generation(model, accelerator):
    """The plain module behind DDP/DeepSpeed wrappers, with ZeRO-3 shards (FSDP2 units: utils/core/fsdp.py) gathered
    while it is used."""
    if is_zero3(accelerator, model):
        with zero3_gathered(model) as module:
            yield module
    else:
        with fsdp2_unsharded(accelerator.unwrap_model(model)) as module:
            yield module


def parameter_gatherer(accelerator, model):
    """A callable that gathers the given parameters of a ZeRO-3 `model` while its context is open
    (`deepspeed.zero.GatheredParameters`), or None when the weights are whole (no ZeRO-3)."""
    if not is_zero3(accelerator, model):
        return None
    import deepspeed

    return lambda params: deepspeed.zero.GatheredParameters(params)


def clear_stale_zero3_gradients(accelerator, model):
    """Zero the ZeRO-3 engine's gradient partitions (`model`: the prepared model). A no-op for other set-ups."""
    if not is_zero3(accelerator, model):
        return
    buffer = getattr(model.optimizer, "grad_partitions_flat_buffer", None)
    if buffer is None:
        raise RuntimeError("this DeepSpeed version's ZeRO-3 optimizer has no grad_partitions_flat_buffer: check "
                           "utils/core/zero3.py against its stage3.py before training with parameters unused in some "
                           "steps")
    buffer.zero_()
