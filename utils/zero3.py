"""A ZeRO-3 gradient fix the training scripts apply before each optimizer step's first backward.

DeepSpeed 0.19.8's stage 3 keeps every gradient partition in one flat buffer and, at the first micro-step of an
optimizer step, copies into it only the gradients that the backward produced (`stage3.py`,
`partition_grads`: `if self.micro_step_id == 0: grad_buffer.copy_(grad_partition)`). A trainable parameter that
gets no gradient in a step keeps the previous step's gradient there, and the optimizer applies it again. That
happens whenever the parameters a step uses change from step to step: the vision tower on a text-only batch, or
on Mix-GRPO's reason steps (the VLM sees no image) after a reflect step (it does). ZeRO-2 and DDP give such a
parameter no gradient; zeroing the buffer first does the same under ZeRO-3."""


def clear_stale_zero3_gradients(accelerator, model):
    """Zero the ZeRO-3 engine's gradient partitions (`model`: the prepared model). A no-op for other set-ups."""
    if accelerator.distributed_type.name != "DEEPSPEED" or model.zero_optimization_stage() != 3:
        return
    buffer = getattr(model.optimizer, "grad_partitions_flat_buffer", None)
    if buffer is None:
        raise RuntimeError("this DeepSpeed version's ZeRO-3 optimizer has no grad_partitions_flat_buffer: check "
                           "utils/zero3.py against its stage3.py before training with parameters unused in some steps")
    buffer.zero_()
