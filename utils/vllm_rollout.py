"""Rollouts with vLLM running in the training process (colocate mode), for GPU users.

Each process runs its own vLLM engine (tensor parallel 1, `external_launcher`) on its own GPU, next to
the policy. Before each generation round the policy's current weights are copied into the engine
(LoRA adapters merged first, ZeRO-3 shards gathered first). Sampling uses one seed per completion,
so a completion does not depend on how requests were batched. Install with
`pip install -r requirements-vllm.txt` (it pins its own torch; use a separate environment).
"""

import torch

from utils.logprobs import hf_core
from utils.rollout import completion_mask, unwrap_for_generation


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "--use_vllm needs vLLM, which is not installed: on a CUDA machine run "
            "`pip install -r requirements-vllm.txt` (in its own environment: vLLM pins its own torch), "
            "or drop --use_vllm to generate with transformers"
        ) from err
    if not torch.cuda.is_available():
        raise RuntimeError("--use_vllm runs on CUDA GPUs only; drop it on the CPU")
    return vllm


class VLLMRollout:
    def __init__(self, model_path, accelerator, cfg, *, gpu_memory_utilization=0.3, max_images_per_prompt=4):
        vllm = require_vllm()
        self.accelerator = accelerator
        self.cfg = cfg
        self.llm = vllm.LLM(
            model=model_path, tensor_parallel_size=1, distributed_executor_backend="external_launcher",
            gpu_memory_utilization=gpu_memory_utilization, seed=cfg.seed + accelerator.process_index,
            max_model_len=(cfg.max_prompt_length or 2048) + cfg.max_completion_length,
            limit_mm_per_prompt={"image": max_images_per_prompt}, dtype="bfloat16" if cfg.bf16 else "auto",
        )
        self._synced_step = None

    def _engine_model(self):
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor.driver_worker, "worker", executor.driver_worker)
        return worker.model_runner.model

    @torch.no_grad()
    def sync_weights(self, policy):
        """Copy the policy's current weights into the vLLM engine (names as in the HF checkpoint)."""
        with unwrap_for_generation(policy, self.accelerator) as unwrapped:
            model = unwrapped.model
            peft = hasattr(model, "merge_adapter")
            if peft:
                model.merge_adapter()
            try:
                weights = []
                for name, param in hf_core(model).named_parameters():
                    if peft:  # LoRA-wrapped layers keep their frozen weight under `.base_layer`
                        if "lora_" in name:
                            continue
                        name = name.replace(".base_layer", "")
                    weights.append((name, param.data))
                self._engine_model().load_weights(weights)
            finally:
                if peft:
                    model.unmerge_adapter()
        self.llm.reset_prefix_cache()

    def generate(self, policy, processor, messages, images, seeds, *, step, stop_ids):
        """One completion per prompt; returns (completion_ids [B, L], completion_mask [B, L]) on the policy's device.
        `stop_ids` are `utils.rollout.stop_token_ids`, the rule the HF path and evaluation use."""
        from vllm import SamplingParams

        if self._synced_step != step:
            self.sync_weights(policy)
            self._synced_step = step
        cfg = self.cfg
        prompts = []
        for msgs, imgs in zip(messages, images):
            text = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            prompts.append({"prompt": text, "multi_modal_data": {"image": list(imgs)}} if imgs else {"prompt": text})
        params = [SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or -1,
                                 max_tokens=cfg.max_completion_length, stop_token_ids=list(stop_ids),
                                 seed=int(s) & 0x7FFFFFFF) for s in seeds]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokenizer = getattr(processor, "tokenizer", processor)
        rows = [list(o.outputs[0].token_ids) for o in outputs]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rows])
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        mask = mask * completion_mask(ids, list(stop_ids))
        device = self.accelerator.device
        return ids.to(device), mask.to(device)
