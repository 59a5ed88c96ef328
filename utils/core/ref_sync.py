"""TR-DPO's reference updates in GRPO (--sync_ref_model, --ref_model_mixup_alpha, --ref_model_sync_steps; TRL's names
and defaults): every `ref_model_sync_steps` optimizer steps the reference moves toward the policy, parameter by
parameter,

    ref <- alpha * policy + (1 - alpha) * ref        (alpha 1: the reference becomes the policy)

Where the weights live decides how:
  DDP, ZeRO-1/2   every process holds whole weights of both models and mixes its own copy (the same numbers on every
                  process, as the policy's are).
  ZeRO-3          each pair of parameters is gathered (DeepSpeed's GatheredParameters, as TRL does it), mixed on the
                  first process and partitioned again from there.
  FSDP2           the policy's shards are gathered one parameter at a time into the reference, which every process
                  holds whole.
  LoRA            the reference is the base with the adapters off, no copy. Syncing gives it adapters of its own: a
                  second set of the LoRA matrices (A and B of every adapted layer), starting from the policy's initial
                  ones (B = 0: the base exactly) and mixed from the policy's as above; alpha 1 makes the reference the
                  policy. Mixing A and B is not mixing their product B A: the parameters are what TR-DPO mixes, and
                  with LoRA these are the parameters. Around each reference pass after the first sync, the policy's
                  adapter weights are swapped for the reference's (before it, the adapters are switched off).

The mixed weights are part of the run's state: `state_tensors` / `load_state_tensors` move them through the checkpoint
(one safetensors file), so a resumed run continues from the same reference.
"""

import contextlib

import torch

from utils.core.logprobs import AdapterDisabledReference
from utils.core.zero3 import is_zero3


def _unwrap(model):
    return getattr(model, "module", model)


def _local(tensor):
    """The part of a tensor this process holds: an FSDP2 shard, or the tensor (DDP; ZeRO-3 inside a gather)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _named(model, only_lora=False):
    return {name: p for name, p in _unwrap(model).named_parameters()
            if not only_lora or ("lora_" in name and p.requires_grad)}


class ReferenceSync:
    """Mixes the policy into the reference every `sync_steps` optimizer steps (`after_step`). `reference` is what
    `prepare_reference_model` built: a model of its own (possibly a DeepSpeed engine), or the LoRA policy with its
    adapters off (`AdapterDisabledReference`, which this gives adapters of its own once it has synced)."""

    def __init__(self, accelerator, policy, reference, *, alpha, sync_steps):
        self.accelerator, self.policy, self.reference = accelerator, policy, reference
        self.alpha, self.sync_steps = float(alpha), int(sync_steps)
        self.zero3 = is_zero3(accelerator)
        self.lora = isinstance(reference, AdapterDisabledReference)
        self.synced = False
        self.adapters = None
        if self.lora:  # the reference's own LoRA matrices: the policy's at the start (B = 0)
            with self._gathered(list(_named(policy, only_lora=True).values())):
                self.adapters = {name: _local(p).detach().clone() for name, p in _named(policy, True).items()}
            reference.adapter_swap = self.swapped_adapters

    @contextlib.contextmanager
    def _gathered(self, params, modify=False):
        """Whole `params` for the block (ZeRO-3: gathered, and re-partitioned from the first process when `modify`).
        Yields whether this process is the one whose changes count."""
        if not self.zero3:
            yield True
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
            yield self.accelerator.process_index == 0 or not modify

    @torch.no_grad()
    def after_step(self, global_step):
        """Sync when `global_step` is a multiple of --ref_model_sync_steps. Returns whether it synced."""
        if global_step % self.sync_steps:
            return False
        a = self.alpha
        if self.lora:
            params = _named(self.policy, only_lora=True)
            with self._gathered(list(params.values())):
                for name, p in params.items():
                    self.adapters[name].mul_(1 - a).add_(_local(p).to(self.adapters[name].dtype), alpha=a)
        else:
            policy, ref = _named(self.policy), _named(self.reference)
            if policy.keys() != ref.keys():
                odd = sorted(policy.keys() ^ ref.keys())[:3]
                raise RuntimeError(f"--sync_ref_model: the reference and the policy name different parameters {odd}")
            for name, r in ref.items():
                p = policy[name]
                with self._gathered([p, r], modify=True) as mine:
                    source = p.full_tensor() if hasattr(p, "full_tensor") and not hasattr(r, "full_tensor") else p
                    if mine:
                        _local(r).mul_(1 - a).add_(_local(source).to(r.dtype), alpha=a)
        self.synced = True
        return True

    @contextlib.contextmanager
    def swapped_adapters(self):
        """LoRA: the policy's adapter weights replaced by the reference's for the block, once the reference has
        synced (yields True); before that nothing changes (yields False: the reference is the adapter-free base)."""
        if not self.synced:
            yield False
            return
        params = _named(self.policy, only_lora=True)
        with self._gathered(list(params.values()), modify=True) as mine:
            saved = {name: _local(p).detach().clone() for name, p in params.items()}
            if mine:
                with torch.no_grad():
                    for name, p in params.items():
                        _local(p).copy_(self.adapters[name])
        try:
            yield True
        finally:
            with self._gathered(list(params.values()), modify=True) as mine, torch.no_grad():
                if mine:
                    for name, p in params.items():
                        _local(p).copy_(saved[name])

    def state_tensors(self):
        """The reference weights syncing has moved, whole, by name ({} before the first sync): LoRA's reference
        adapters, or the reference's weights (gathered under ZeRO-3: every process calls this). Every process holds
        the same numbers, so the main process's copy is what a checkpoint keeps."""
        if not self.synced:
            return {}
        if self.lora:
            return {f"adapter.{k}": v.contiguous() for k, v in self.adapters.items()}
        out = {}
        for name, r in _named(self.reference).items():
            with self._gathered([r]):
                out[name] = _local(r).detach().clone().contiguous()
        return out

    @torch.no_grad()
    def load_state_tensors(self, tensors):
        """Restore `state_tensors` on every process (a resumed run); {}: the saved run had not synced yet."""
        if not tensors:
            return
        self.synced = True
        if self.lora:
            self.adapters = {k[len("adapter."):]: v.clone() for k, v in tensors.items()}
            return
        for name, r in _named(self.reference).items():
            with self._gathered([r], modify=True) as mine:
                if mine:
                    _local(r).copy_(tensors[name].to(r.device))
