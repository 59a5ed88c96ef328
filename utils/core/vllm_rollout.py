"""Rollouts with vLLM running in the training process (colocate mode), fed and masked like the HF path.

Each process runs its own engine (`external_launcher`; with --vllm_tensor_parallel_size t, one engine per t processes)
on its own GPU, next to the policy. The
engine sees what training scores: the trainer's own prompt token ids (placeholders expanded by the trainer's
processor; same pixel budget, echoed ids checked), the same stop and suppressed ids, the same sampling flags,
one seed per completion (a completion does not depend on how requests were batched). vLLM's log-prob of each
sampled token (`logprobs_mode="processed_logprobs"`) comes back with it; its gap to the trainer's is logged and
truncated importance sampling corrects it (`utils.core.importance`, TRL's `vllm_importance_sampling_*`): token t's
policy loss is multiplied by min(pi_train(t) / pi_vllm(t), cap).

Weights go to the engine one parameter at a time (only that one gathered under ZeRO-3), LoRA as vLLM adapter or merged
one layer at a time into a temporary (`utils.core.vllm_weights`); frozen weights are never sent. The flags and their
checks: `utils.core.vllm_flags`; server mode: `utils.core.vllm_server_rollout`. Install: `pip install -r
requirements-vllm.txt` (docs/distributed.md).
"""

import atexit
import json
import math
import os
import shutil
import socket
import tempfile

import torch

from utils.core.encoding import encode_prompts
from utils.core.fsdp import fsdp2_unsharded
from utils.core.importance import importance_weights
from utils.core.rollout import completion_mask, special_token_ids_to_suppress
from utils.core.video import vllm_video, vllm_video_processor_kwargs
from utils.core.vllm_flags import flag, lora_sync_mode
from utils.core.vllm_weights import adapter_files, adapter_layers, iter_sync_weights, vllm_max_lora_rank
from utils.core.zero3 import parameter_gatherer


def require_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "--use_vllm needs vLLM, which is not installed: on a CUDA machine run "
            "`pip install -r requirements-vllm.txt`, or drop --use_vllm to generate with transformers"
        ) from err
    if not torch.cuda.is_available():
        raise RuntimeError("--use_vllm runs colocated engines on CUDA GPUs only; drop it on the CPU (or generate on a "
                           "server: --vllm_mode server)")
    return vllm


# ----------------------------------------------------------------------------------------------
# Engine set-up (pure: tested without vLLM)
# ----------------------------------------------------------------------------------------------


def set_distributed_env(rank, local_rank, world_size, environ=None):
    """What `external_launcher` reads, set as TRL does: RANK / LOCAL_RANK / WORLD_SIZE from accelerate,
    MASTER_ADDR kept or localhost, MASTER_PORT kept or (unset, 0, auto) a free port. Returns the values."""
    environ = os.environ if environ is None else environ
    environ["RANK"], environ["LOCAL_RANK"], environ["WORLD_SIZE"] = str(rank), str(local_rank), str(world_size)
    environ["MASTER_ADDR"] = environ.get("MASTER_ADDR") or "localhost"
    if environ.get("MASTER_PORT", "").strip().lower() in ("", "0", "auto"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            environ["MASTER_PORT"] = str(s.getsockname()[1])
    return {k: environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def is_vision_language(model_config):
    return hasattr(model_config, "vision_config")


# vLLM's processors for these families take videos too: a video limit of 0 spares the memory vLLM would reserve for
# one (Gemma 3's and Idefics3's vLLM processors take images only and would refuse a "video" key).
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "glm4v", "llava_onevision", "gemma4")
_PAN_AND_SCAN = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")


def mm_processor_kwargs(processor=None, cfg=None, video_budget=None):
    """The image budget of the trainer's processor for vLLM's own, so each image expands to the tokens the trainer's
    prompt ids hold: Qwen-VL/GLM `size` (pixel budget), InternVL tile limits, Idefics3/SmolVLM `size` longest_edge
    (vLLM needs it a multiple of the tile edge), Gemma 3 pan-and-scan, Gemma 4's soft-token budget. From the
    processor, else from the flags.
    With a `video_budget` (utils.core.video), the video processor's bounds and no resampling of the given frames."""
    image_processor = getattr(processor, "image_processor", None)
    out = {}
    if image_processor is not None:
        size = dict(getattr(image_processor, "size", None) or {})
        if size.get("shortest_edge") is not None and size.get("longest_edge") is not None:
            out["size"] = {"shortest_edge": int(size["shortest_edge"]), "longest_edge": int(size["longest_edge"])}
        elif size.get("longest_edge") is not None and getattr(image_processor, "max_image_size", None):
            out["size"] = {"longest_edge": int(size["longest_edge"])}
        if getattr(image_processor, "crop_to_patches", False) and getattr(image_processor, "max_patches", None):
            out.update(crop_to_patches=True, max_patches=int(image_processor.max_patches))
        if getattr(image_processor, "max_soft_tokens", None) is not None:  # Gemma 4: vLLM's own default is not ours
            out["max_soft_tokens"] = int(image_processor.max_soft_tokens)
        if getattr(image_processor, "do_pan_and_scan", None) is not None:
            on = out["do_pan_and_scan"] = bool(image_processor.do_pan_and_scan)
            out.update({name: getattr(image_processor, name) for name in _PAN_AND_SCAN if on})
    elif cfg is not None:
        for name in ("min_pixels", "max_pixels"):  # overrides vLLM's Qwen-VL processors understand
            if getattr(cfg, name, None) is not None:
                out[name] = int(getattr(cfg, name))
        if getattr(cfg, "max_anyres_num", None) is not None:
            out.update(crop_to_patches=True, max_patches=int(cfg.max_anyres_num))
    if video_budget is not None:
        out.update(vllm_video_processor_kwargs(video_budget))
    return out


def engine_kwargs(model_path, cfg, *, vision_language, seed, mm_kwargs=None, max_images_per_prompt=4,
                  max_videos_per_prompt=0, model_type=None, lora_rank=None):
    """Arguments of `vllm.LLM` for one colocated engine (`model_type`: the family, for its multimodal limits;
    `lora_rank`: the rank of the LoRA adapter it will be given, for --vllm_lora_sync adapter)."""
    max_len = flag(cfg, "vllm_max_model_len") or getattr(cfg, "vllm_max_model_length", None)  # TRL's name
    if max_len is None and getattr(cfg, "max_prompt_length", None):
        max_len = cfg.max_prompt_length + cfg.max_completion_length
    kwargs = dict(
        model=str(model_path), tensor_parallel_size=int(flag(cfg, "vllm_tensor_parallel_size")),
        distributed_executor_backend="external_launcher", model_impl=flag(cfg, "vllm_model_impl"),
        gpu_memory_utilization=flag(cfg, "vllm_gpu_memory_utilization"), seed=seed,
        dtype="bfloat16" if getattr(cfg, "bf16", False) else getattr(cfg, "dtype", "auto"),
        enable_sleep_mode=bool(flag(cfg, "vllm_enable_sleep_mode")),
        enforce_eager=bool(flag(cfg, "vllm_enforce_eager")),
        # log-probs after temperature (and top-k / top-p): what the trainer's log-probs at --temperature are
        logprobs_mode="processed_logprobs",
    )
    optional = dict(max_model_len=max_len, max_num_seqs=flag(cfg, "vllm_max_num_seqs"),
                    max_num_batched_tokens=flag(cfg, "vllm_max_num_batched_tokens"))
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if lora_rank is not None:  # one adapter at a time: the policy's, replaced after every sync
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(lora_rank))
    if vision_language:  # vLLM refuses limit_mm_per_prompt for text-only models
        video = {"video": 0} if model_type in VIDEO_FAMILIES else {}
        if max_videos_per_prompt:
            video = {"video": max_videos_per_prompt}
        kwargs["limit_mm_per_prompt"] = {"image": max_images_per_prompt, **video}
        if mm_kwargs:
            kwargs["mm_processor_kwargs"] = dict(mm_kwargs)
    return kwargs


def sampling_kwargs(cfg, *, seed, stop_ids, suppress_ids):
    """Arguments of `vllm.SamplingParams` for one completion, the same sampling as the HF path."""
    return dict(
        n=1, temperature=cfg.temperature, top_p=getattr(cfg, "top_p", 1.0), top_k=getattr(cfg, "top_k", None) or 0,
        max_tokens=cfg.max_completion_length, stop_token_ids=sorted(int(i) for i in stop_ids),
        # suppressed exactly as HF's suppress_tokens does: their logits become -inf
        logit_bias={int(i): -math.inf for i in suppress_ids} or None,
        seed=int(seed) & 0x7FFFFFFF, logprobs=0, detokenize=False,
    )


def prompt_token_ids(prompt_batch, prompt_index=None):
    """The trainer's prompt ids, one list per completion (left padding dropped; `prompt_index` maps
    completions to shared prompt rows)."""
    ids, mask = prompt_batch["input_ids"].cpu(), prompt_batch["attention_mask"].cpu().bool()
    rows = [r[m].tolist() for r, m in zip(ids, mask)]
    return rows if prompt_index is None else [rows[i] for i in torch.as_tensor(prompt_index).tolist()]


def vllm_prompts(token_ids, images, videos=None):
    """vLLM prompt dicts: token ids plus the images (and `utils.core.video.Clip`s) they hold placeholders for."""
    out = []
    for k, (ids, imgs) in enumerate(zip(token_ids, images)):
        row = {"prompt_token_ids": list(ids)}
        if imgs:
            row["multi_modal_data"] = {"image": list(imgs) if len(imgs) > 1 else imgs[0]}
        if videos and videos[k]:
            row.setdefault("multi_modal_data", {})["video"] = [vllm_video(clip) for clip in videos[k]]
        out.append(row)
    return out


def unpack_outputs(outputs, sent_ids, *, pad_token_id, stop_ids):
    """(completion_ids [B, L], completion_mask [B, L], sampler log-probs [B, L] fp32 or None) from vLLM's
    request outputs (`pack_completions` on their ids and log-probs)."""
    rows = [list(o.outputs[0].token_ids) for o in outputs]
    logps = None
    if all(o.outputs[0].logprobs is not None for o in outputs):
        logps = [[entry[t].logprob if t in entry else math.nan for t, entry in zip(row, o.outputs[0].logprobs)]
                 for row, o in zip(rows, outputs)]
    return pack_completions(rows, logps, [list(o.prompt_token_ids) for o in outputs], sent_ids,
                            pad_token_id=pad_token_id, stop_ids=stop_ids)


def pack_completions(rows, logps, echoed, sent_ids, *, pad_token_id, stop_ids, where="vLLM"):
    """(completion_ids [B, L], completion_mask [B, L], log-probs [B, L] fp32 or None) from the engine's sampled
    token ids (one list per completion), their log-probs (lists, NaN where missing; or None) and the prompt ids it
    echoed, which must be the trainer's. The mask is the HF path's (up to and including the first stop id).
    Log-probs are 0 after a completion's end."""
    for i, (echo, sent) in enumerate(zip(echoed, sent_ids)):
        if list(echo) != list(sent):
            raise RuntimeError(
                f"{where} turned prompt {i} into {len(echo)} tokens where the trainer has {len(sent)}: its image "
                "processor resized the images differently (pixel budget: --max_pixels / --min_pixels; a server "
                "takes them as vllm_serve.py --mm_processor_kwargs)")
    width = max([1] + [len(r) for r in rows])
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        if logps is not None:
            out[i, : len(row)] = torch.tensor(logps[i], dtype=torch.float32)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long() * completion_mask(ids, list(stop_ids))
    return ids, mask, (out if logps is not None else None)


def _lora_request_class(vllm):
    try:
        return vllm.lora.request.LoRARequest
    except AttributeError:
        from vllm.lora.request import LoRARequest

        return LoRARequest


def request_inputs(rollout, policy, processor, messages, images, seeds, *, step, stop_ids, suppress_ids, prompt_batch,
                   prompt_index, videos=None):
    """What a generate call sends, checked: (tokenizer, suppressed ids, the prompt ids of each completion). The
    engine first takes the policy's weights when `step` moved on (`rollout.sync_weights`)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if suppress_ids is None:
        suppress_ids = special_token_ids_to_suppress(tokenizer, stop_ids)
    if prompt_batch is None:
        prompt_batch, prompt_index = encode_prompts(processor, messages, images, videos=videos,
                                                    sample_ids=[str(i) for i in range(len(messages))]), None
    sent = prompt_token_ids(prompt_batch, prompt_index)
    if not len(sent) == len(images) == len(seeds):
        raise ValueError(f"vLLM generate: {len(sent)} prompts, {len(images)} image lists and {len(seeds)} seeds; "
                         "give one of each per completion")
    if rollout._synced_step != step:
        rollout.sync_weights(policy)
        rollout._synced_step = step
    return tokenizer, suppress_ids, sent


def on_device(ids, mask, logps, device, return_logprobs):
    """A generate call's answer: (ids, mask) or (ids, mask, sampler log-probs) on the policy's device."""
    if not return_logprobs:
        return ids.to(device), mask.to(device)
    if logps is None:
        raise RuntimeError("vLLM returned no log-probs for the sampled tokens (SamplingParams.logprobs=0)")
    return ids.to(device), mask.to(device), logps.to(device)


def tensor_parallel_group(world_size, tp):
    """This process's group of `tp` consecutive ranks (every process takes part in making all of them)."""
    if world_size % tp:
        raise ValueError(f"--vllm_tensor_parallel_size {tp} does not divide the {world_size} processes")
    group, _ = torch.distributed.new_subgroups_by_enumeration(
        [list(range(start, start + tp)) for start in range(0, world_size, tp)])
    return group


def gather_in_group(parts, group, rank_in_group):
    """Each list of `parts` concatenated over the group's processes in rank order, and the slice of this process's
    entries (a None part, e.g. no videos, stays None when every process has None; tensors travel as lists)."""
    parts = tuple(p.tolist() if torch.is_tensor(p) else p for p in parts)
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, parts, group=group)
    start = sum(len(p[0]) for p in gathered[:rank_in_group])
    joined = []
    for k in range(len(parts)):
        pieces = [p[k] for p in gathered]
        joined.append(None if all(x is None for x in pieces) else [
            x for piece, p in zip(pieces, gathered) for x in (piece if piece is not None else [None] * len(p[0]))])
    return tuple(joined), slice(start, start + len(parts[0]))


class VLLMRollout:
    """One colocated vLLM engine per process (or per --vllm_tensor_parallel_size processes). `vllm` (the module) is
    injectable for tests."""

    def __init__(self, model_path, accelerator, cfg, *, processor=None, model_config=None, max_images_per_prompt=4,
                 vllm=None, max_videos_per_prompt=0, video_budget=None):
        vllm = vllm or require_vllm()
        self.vllm, self.accelerator, self.cfg = vllm, accelerator, cfg
        if model_config is None:
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(model_path)
        self.vision_language = is_vision_language(model_config)
        self.max_images = max_images_per_prompt
        mode = flag(cfg, "vllm_importance_sampling_mode")
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mode=mode,
                           cap=flag(cfg, "vllm_importance_sampling_cap"))  # bad flags fail before the engine starts
        set_distributed_env(accelerator.process_index, accelerator.local_process_index, accelerator.num_processes)
        # --vllm_tensor_parallel_size t: each engine spans t consecutive processes, which generate their prompts
        # together (TRL's grouping) and share a seed
        self.tp = int(flag(cfg, "vllm_tensor_parallel_size"))
        self.tp_group = tensor_parallel_group(accelerator.num_processes, self.tp) if self.tp > 1 else None
        # LoRA (--vllm_lora_sync): the adapter goes to vLLM as a LoRA request from a folder of this process
        self.lora_mode, self.lora_request, self._lora_id = lora_sync_mode(cfg), None, 0
        if self.lora_mode == "adapter":
            self.lora_dir = tempfile.mkdtemp(prefix=f"mmgrpo-lora-{accelerator.process_index}-",
                                             dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            atexit.register(shutil.rmtree, self.lora_dir, True)
        self.llm = vllm.LLM(**engine_kwargs(
            model_path, cfg, vision_language=self.vision_language, seed=cfg.seed + accelerator.process_index // self.tp,
            mm_kwargs=mm_processor_kwargs(processor, cfg, video_budget), max_images_per_prompt=max_images_per_prompt,
            max_videos_per_prompt=max_videos_per_prompt, model_type=getattr(model_config, "model_type", None),
            lora_rank=cfg.lora_r if self.lora_mode == "adapter" else None))
        self.sleep_mode = bool(flag(cfg, "vllm_enable_sleep_mode"))
        self._synced_step, self._asleep = None, set()
        if self.sleep_mode:  # leave the memory to training until the first generation round
            self.sleep()
        accelerator.wait_for_everyone()

    def sync_after_step(self, policy, step):
        """Colocated engines take the new weights before the next round (`generate`), not after every step."""

    def _engine_model(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model

    def sleep(self):
        """Free the engine's GPU memory (weights and KV cache) until the next `generate`; no-op without
        --vllm_enable_sleep_mode."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=2)  # level 2 drops the weights too: the next round reloads them from the policy
            self._synced_step, self._asleep = None, {"weights", "kv_cache"}

    @torch.no_grad()
    def sync_weights(self, policy):
        """Copy the policy's current trainable (and LoRA-merged) weights into the engine."""
        if "weights" in self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
        wrapper = self.accelerator.unwrap_model(policy)
        engine, gather = self._engine_model(), parameter_gatherer(self.accelerator, policy)
        layers = adapter_layers(wrapper.model) if self.lora_mode == "adapter" else {}
        with fsdp2_unsharded(wrapper):  # FSDP2: whole weights while they are read (a no-op otherwise)
            for name, tensor in iter_sync_weights(wrapper.model, gather, adapter_layers=layers):
                engine.load_weights([(name, tensor)])
            if layers:
                self._load_adapter(wrapper.model, layers, gather)
        self.llm.reset_prefix_cache()

    def _load_adapter(self, model, layers, gather):
        """The policy's adapter as a new LoRA request (a new id, so vLLM loads it); the previous one is dropped."""
        from safetensors.torch import save_file

        config, tensors = adapter_files(model, layers, gather)
        self._lora_id += 1
        folder = os.path.join(self.lora_dir, f"adapter-{self._lora_id}")
        os.makedirs(folder)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        old, self.lora_request = self.lora_request, _lora_request_class(self.vllm)(
            lora_name=f"policy-{self._lora_id}", lora_int_id=self._lora_id, lora_path=folder)
        if old is not None:
            remove = getattr(self.llm.llm_engine, "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(self, policy, processor, messages, images, seeds, *, step, stop_ids, suppress_ids=None,
                 prompt_batch=None, prompt_index=None, return_logprobs=False, videos=None):
        """One completion per prompt: (completion_ids [B, L], completion_mask [B, L]) on the policy's device,
        and vLLM's log-probs of the sampled tokens [B, L] with return_logprobs=True.

        Prompts are `prompt_batch` (the trainer's `encode_prompts` output; `prompt_index` maps completions to
        its rows), else `messages` / `images` encoded by `encode_prompts` here. `stop_ids` / `suppress_ids` are
        `utils.core.rollout.stop_token_ids` / `special_token_ids_to_suppress` (computed here when not given). `videos`:
        per completion, its `utils.core.video.Clip`s (the frames the trainer's processor got).
        """
        for i, imgs in enumerate(images):
            if len(imgs) > self.max_images:
                raise ValueError(f"prompt {i} has {len(imgs)} images; the vLLM engine takes at most {self.max_images}")
        tokenizer, suppress_ids, sent = request_inputs(self, policy, processor, messages, images, seeds, step=step,
                                                       stop_ids=stop_ids, suppress_ids=suppress_ids,
                                                       prompt_batch=prompt_batch, prompt_index=prompt_index,
                                                       videos=videos)
        if "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        requests, mine = (sent, images, videos, seeds), slice(0, len(sent))
        if self.tp_group is not None:  # the engine generates the whole tensor-parallel group's prompts
            requests, mine = gather_in_group(requests, self.tp_group, self.accelerator.process_index % self.tp)
        all_sent, all_images, all_videos, all_seeds = requests
        params = [self.vllm.SamplingParams(**sampling_kwargs(self.cfg, seed=s, stop_ids=stop_ids,
                                                             suppress_ids=suppress_ids)) for s in all_seeds]
        lora = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outputs = self.llm.generate(vllm_prompts(all_sent, all_images, all_videos), params, use_tqdm=False, **lora)
        ids, mask, logps = unpack_outputs(outputs[mine], sent, pad_token_id=tokenizer.pad_token_id,
                                          stop_ids=stop_ids)
        return on_device(ids, mask, logps, self.accelerator.device, return_logprobs)
