"""GRPO for vision-language models (and text LLMs), in one readable script.

    accelerate launch train_grpo.py                                   # tiny CPU recipe
    accelerate launch train_grpo.py --config recipes/crystal_cpr.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml train_grpo.py --config ...

For each prompt q, sample G completions, score them with the reward functions, normalise the
weighted reward within each group into advantages, and minimise the clipped surrogate (plus an
optional k3 KL to a frozen reference). DESIGN.md section 4 has the formulas.
"""

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from transformers import get_scheduler

from kernels import group_advantages
from rewards import get_reward
from utils.args import choice, config_to_dict, parse_config, save_config
from utils.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from utils.curriculum import CurriculumSampler, combine_with_rating, levels_from_scores, stage_indices
from utils.data import images_of, load_vqa
from utils.evaluation import evaluate_policy, load_eval_set
from utils.hub import HubUploader
from utils.launch import relaunch_multi_cpu_if_needed, set_cpu_threads
from utils.logging import RunLogger, peak_memory_mb, plot_reward_curve, tracker_list, write_summary
from utils.losses import IMPORTANCE_LEVELS, LOSS_TYPES, clipped_policy_loss
from utils.models import load_model_and_processor, prepare_for_training
from utils.pcgrad import pcgrad_backward
from utils.prompts import PROMPT_TEMPLATES, build_messages
from utils.rollout import (CompletionLogProbs, can_share_prompts, completion_seeds, encode_prompts, expand_prompts,
                           generate_completions,
                           prepare_reference_model, special_token_ids_to_suppress,
                           unwrap_for_generation)
from utils.vllm_rollout import VLLMRollout, require_vllm
from utils.tiny import TINY_DATASET, TINY_MODEL, TINY_RECIPE, resolve_tiny


@dataclass
class GRPOConfig:
    # model
    model_name_or_path: str = field(default=TINY_MODEL, metadata={"help": "hub name or folder; 'tiny' builds the tiny VLM"})
    dtype: str = choice("auto", "float32", "bfloat16", "float16", help="weights dtype when loading")
    attn_implementation: Optional[str] = None
    freeze_vision_tower: bool = False
    gradient_checkpointing: bool = False
    bf16: bool = False
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    max_pixels: Optional[int] = None
    min_pixels: Optional[int] = None
    max_anyres_num: Optional[int] = None
    # data
    dataset_name: str = field(default=TINY_DATASET, metadata={"help": "hub name, save_to_disk folder or data file; 'synthetic:shapes' makes one"})
    dataset_split: str = "train"
    image_column: Optional[str] = field(default="image", metadata={"help": "'none' for text-only data"})
    question_column: str = "question"
    answer_column: str = "answer"
    steps_column: str = "reference_steps"
    choices_column: Optional[str] = None
    prompt_template: str = choice(*PROMPT_TEMPLATES)
    system_prompt: Optional[str] = None
    # rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["format", "accuracy"])
    reward_weights: Optional[list[float]] = None
    reward_kwargs: dict = field(default_factory=dict, metadata={"help": 'JSON, e.g. {"cpr": {"answer_weight": 0.6}}'})
    # GRPO
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_prompt_length: Optional[int] = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    loss_type: str = choice(*LOSS_TYPES)
    importance_sampling_level: str = choice(*IMPORTANCE_LEVELS)
    scale_rewards: str = choice("group", "batch", "none")
    num_iterations: int = 1
    use_vllm: bool = False
    use_pcgrad: bool = field(default=False, metadata={"help": "one loss per reward, gradients combined with PCGrad"})
    allow_double_accuracy: bool = field(default=False, metadata={"help": "allow accuracy next to cpr (counts the answer twice)"})
    # difficulty curriculum (OpenVLThinker)
    curriculum: list[str] = field(default_factory=list, metadata={"help": "stages in order, e.g. medium,hard"})
    difficulty_column: str = "difficulty"
    difficulty_samples: int = field(default=0, metadata={"help": "k rollouts per question to estimate difficulty; 0: use --difficulty_column"})
    difficulty_reward: str = "accuracy"
    rating_column: Optional[str] = field(default=None, metadata={"help": "quality rating in [0, 1] averaged into the difficulty"})
    difficulty_split: str = choice("tertiles", "thresholds")
    difficulty_thresholds: list[float] = field(default_factory=lambda: [1 / 3, 2 / 3])
    # optimisation
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_steps: int = -1
    num_train_epochs: float = 1.0
    seed: int = 42
    cpu_threads: Optional[int] = field(default=None, metadata={"help": "torch threads per process without a GPU; default: the cores shared evenly between this machine's processes"})
    # run
    output_dir: str = "outputs/grpo"
    logging_steps: int = 1
    save_steps: int = 100
    save_total_limit: Optional[int] = None
    resume_from_checkpoint: Optional[str] = None
    report_to: str = "tensorboard"
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None
    log_completions: int = 4
    # held-out evaluation (greedy accuracy), before and after training
    eval_dataset_name: Optional[str] = field(default=None, metadata={"help": "VQA set for held-out accuracy; none: no evaluation"})
    eval_split: str = "test"
    eval_samples: Optional[int] = 256
    eval_batch_size: int = 64
    eval_max_new_tokens: int = 128
    eval_before: bool = field(default=True, metadata={"help": "also evaluate the starting model"})


def validate(cfg, num_processes):
    """Every flag combination that cannot work fails here, before a model is loaded."""
    global_batch = cfg.per_device_train_batch_size * num_processes
    if global_batch % cfg.num_generations:
        raise ValueError(
            f"--per_device_train_batch_size {cfg.per_device_train_batch_size} x {num_processes} processes = "
            f"{global_batch} completions is not a multiple of --num_generations {cfg.num_generations}")
    if cfg.num_generations < 2 and cfg.scale_rewards == "group":
        raise ValueError("--num_generations 1 gives every group a zero advantage; use 2 or more")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward_funcs):
        raise ValueError(f"--reward_weights has {len(cfg.reward_weights)} values for {len(cfg.reward_funcs)} --reward_funcs")
    if cfg.temperature <= 0:
        raise ValueError("--temperature must be > 0 for GRPO sampling")
    if "cpr" in cfg.reward_funcs and "accuracy" in cfg.reward_funcs and not cfg.allow_double_accuracy:
        raise ValueError("--reward_funcs has both accuracy and cpr, and cpr already rewards the answer, so a correct "
                         "answer would count twice; drop accuracy, or pass --allow_double_accuracy to mean it")
    if cfg.curriculum and cfg.difficulty_samples < 0:
        raise ValueError("--difficulty_samples must be >= 0")
    if cfg.use_vllm:
        require_vllm()
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id")
    if cfg.num_iterations > 1 and cfg.save_steps % cfg.num_iterations:
        raise ValueError(f"--save_steps {cfg.save_steps} must be a multiple of --num_iterations {cfg.num_iterations} "
                         "(checkpoints are taken between generation rounds)")


def main(cfg: GRPOConfig):
    # cpu=True when there is no GPU: `accelerate launch --cpu` does not pass it on to the workers.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              mixed_precision="bf16" if cfg.bf16 else "no", log_with=tracker_list(cfg.report_to),
                              project_dir=cfg.output_dir)
    validate(cfg, accelerator.num_processes)
    set_cpu_threads(cfg.cpu_threads)
    set_seed(cfg.seed)
    rank, world = accelerator.process_index, accelerator.num_processes
    B, G, GA, mu = cfg.per_device_train_batch_size, cfg.num_generations, cfg.gradient_accumulation_steps, cfg.num_iterations
    prompts_per_micro = B * world // G

    # ---- data and rewards (validated before any model is loaded) ----
    model_path, dataset_path = resolve_tiny(cfg, accelerator)
    needs_steps = any(name in ("cpr", "reasoning", "spr") for name in cfg.reward_funcs)
    dataset = load_vqa(dataset_path, split=cfg.dataset_split, image_column=cfg.image_column,
                       question_column=cfg.question_column, answer_column=cfg.answer_column,
                       steps_column=cfg.steps_column, choices_column=cfg.choices_column, require_steps=needs_steps)
    unknown = set(cfg.reward_kwargs) - set(cfg.reward_funcs)
    if unknown:
        raise ValueError(f"--reward_kwargs names {sorted(unknown)}, which are not in --reward_funcs {cfg.reward_funcs}")
    reward_fns = [get_reward(name, **cfg.reward_kwargs.get(name, {})) for name in cfg.reward_funcs]
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_fns), dtype=torch.float32)
    reward_columns = [c for c in dataset.column_names if c != "image"]
    eval_set = load_eval_set(cfg, accelerator)

    # ---- model, reference, optimiser ----
    model, processor = load_model_and_processor(model_path, dtype=cfg.dtype, attn_implementation=cfg.attn_implementation,
                                                freeze_vision_tower=cfg.freeze_vision_tower, max_pixels=cfg.max_pixels,
                                                min_pixels=cfg.min_pixels, max_anyres_num=cfg.max_anyres_num)
    tokenizer = getattr(processor, "tokenizer", processor)
    model = prepare_for_training(model, cfg)

    eos_ids = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else [])
    eos_ids = sorted(set(i for i in eos_ids if i is not None))
    suppress_ids = special_token_ids_to_suppress(tokenizer, eos_ids)
    policy = CompletionLogProbs(model)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    rounds_per_epoch = math.ceil(len(dataset) / (prompts_per_micro * GA))
    max_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * rounds_per_epoch) * mu
    # Stepped by hand once per optimizer step (not prepared): the schedule then does not depend on the
    # number of processes, which keeps 1-process and N-process runs identical.
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(cfg.warmup_ratio * max_steps),
                              num_training_steps=max_steps)
    if accelerator.state.deepspeed_plugin is not None:
        # No DataLoader is prepared, so DeepSpeed learns the micro-batch and clipping from us.
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = B
        ds_config["gradient_clipping"] = cfg.max_grad_norm
    policy, optimizer = accelerator.prepare(policy, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    ref_policy = prepare_reference_model(cfg, model_path, policy, accelerator) if cfg.beta != 0.0 else None
    vllm = VLLMRollout(model_path, accelerator, cfg) if cfg.use_vllm else None  # clear error without vLLM

    if cfg.use_pcgrad and accelerator.distributed_type.name == "DEEPSPEED":
        raise ValueError("--use_pcgrad needs per-objective gradients, which DeepSpeed does not expose; use DDP")

    # ---- resume, then the (curriculum) sampler: difficulty levels are estimated once and checkpointed ----
    global_step, round_index, state = 0, 0, {}
    resume_path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if resume_path:
        state = load_checkpoint(accelerator, resume_path)
        global_step, round_index = state["global_step"], state["round_index"]
        accelerator.print(f"resumed from {resume_path} at step {global_step}")
    stages = {"all": list(range(len(dataset)))}
    if cfg.curriculum:
        levels = state.get("difficulty_levels") or difficulty_levels(cfg, dataset, policy, processor, accelerator,
                                                                     reward_fns, eos_ids, suppress_ids)
        stages = stage_indices(levels, cfg.curriculum)
        accelerator.print("curriculum: " + ", ".join(f"{k} {len(v)} questions" for k, v in stages.items()))
    sampler = CurriculumSampler(stages, seed=cfg.seed, total_steps=max_steps)
    if state:
        sampler.load_state_dict(state["sampler"])
    if accelerator.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"))
    logger = RunLogger(cfg.output_dir, accelerator, report_to=cfg.report_to, config=config_to_dict(cfg),
                       total_steps=max_steps, start_step=global_step)
    uploader = HubUploader(cfg.hub_model_id) if cfg.push_to_hub and accelerator.is_main_process else None

    def evaluate():
        return evaluate_policy(policy, processor, eval_set, cfg, accelerator, prompt_template=cfg.prompt_template)

    heldout_before = state.get("heldout_before")
    if eval_set is not None and cfg.eval_before and global_step == 0:
        heldout_before = evaluate()
        accelerator.print(f"held-out accuracy before GRPO: {heldout_before['accuracy']:.3f} ({heldout_before['samples']} questions)")
    train_start = time.perf_counter()

    while global_step < max_steps:
        # ---- 1. rollout: GA micro-batches of B completions per process, G per prompt across processes ----
        round_start = time.perf_counter()
        timings = dict.fromkeys(("generation", "rewards", "logprob", "backward"), 0.0)
        buffer, round_stats = [], []
        policy.eval()
        for micro in range(GA):
            prompt_idx = sampler.take(prompts_per_micro, global_step)
            global_rows = [i for i in prompt_idx for _ in range(G)]
            local = slice(rank * B, (rank + 1) * B)
            rows = [dataset[i] for i in global_rows[local]]
            ids = [str(r.get("id", i)) for r, i in zip(rows, global_rows[local])]
            messages = [build_messages(r["question"], num_images=len(images_of(r)), choices=r.get("choices"),
                                       template=cfg.prompt_template, system_prompt=cfg.system_prompt) for r in rows]
            # When the model allows it, each prompt is encoded once and its G completions share its forward
            # pass in training (prompt_index maps completions to prompts); generation runs one row each.
            local_idx = global_rows[local]
            unique = sorted(set(local_idx), key=local_idx.index)
            first = [local_idx.index(i) for i in unique]
            if can_share_prompts(model, [len(images_of(rows[j])) for j in first]):
                prompt_index = torch.tensor([unique.index(i) for i in local_idx], device=accelerator.device)
            else:
                prompt_index, first = None, list(range(len(rows)))
            prompt_batch = encode_prompts(processor, [messages[j] for j in first], [images_of(rows[j]) for j in first],
                                          sample_ids=[ids[j] for j in first],
                                          max_prompt_length=cfg.max_prompt_length).to(accelerator.device)
            batch = expand_prompts(prompt_batch, prompt_index) if prompt_index is not None else prompt_batch
            seeds = completion_seeds(cfg.seed, round_index, range(micro * B * world + rank * B, micro * B * world + (rank + 1) * B))
            t0 = time.perf_counter()
            if vllm is not None:
                completion_ids, completion_mask = vllm.generate(policy, processor, messages, [images_of(r) for r in rows],
                                                                seeds, step=global_step)
            else:
                with unwrap_for_generation(policy, accelerator) as unwrapped:
                    completion_ids, completion_mask = generate_completions(
                        unwrapped.model, batch, row_seeds=seeds, max_new_tokens=cfg.max_completion_length,
                        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=eos_ids,
                        pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress_ids)
            timings["generation"] += time.perf_counter() - t0
            texts = tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                           skip_special_tokens=True)

            # ---- 2. rewards on this process, advantages over whole groups (gathered across processes) ----
            t0 = time.perf_counter()
            columns = {c: [r[c] for r in rows] for c in reward_columns}
            token_ids = [ids[m.bool()].tolist() for ids, m in zip(completion_ids, completion_mask)]
            local_rewards = torch.full((B, len(reward_fns)), float("nan"))
            for j, fn in enumerate(reward_fns):
                for k, value in enumerate(fn(texts, completion_ids=token_ids, **columns)):
                    if value is not None:
                        local_rewards[k, j] = float(value)
            all_rewards = accelerator.gather(local_rewards.to(accelerator.device)).cpu()
            if cfg.use_pcgrad:  # one advantage per reward function, each normalised within its groups
                advantages = torch.stack([group_advantages(all_rewards[:, j], G, scale=cfg.scale_rewards)
                                          for j in range(len(reward_fns))], dim=-1)[local]
            else:
                advantages = group_advantages(all_rewards, G, weights=reward_weights, scale=cfg.scale_rewards)[local]
            timings["rewards"] += time.perf_counter() - t0

            # ---- 3. log-probs that stay fixed for this round: behaviour policy (mu > 1) and reference ----
            t0 = time.perf_counter()
            with torch.no_grad():
                old_logps = (policy(prompt_batch, completion_ids, completion_mask, cfg.temperature, prompt_index=prompt_index)
                             if mu > 1 else None)
                ref_logps = (ref_policy(prompt_batch, completion_ids, completion_mask, cfg.temperature,
                                        prompt_index=prompt_index) if ref_policy else None)
            timings["logprob"] += time.perf_counter() - t0
            buffer.append(dict(batch=prompt_batch, prompt_index=prompt_index, completion_ids=completion_ids, completion_mask=completion_mask,
                               advantages=advantages.to(accelerator.device), old_logps=old_logps, ref_logps=ref_logps))
            round_stats.append(dict(rewards=all_rewards, lengths=accelerator.gather(completion_mask.sum(-1)).float().cpu(),
                                    samples=[dict(id=i, prompt=m[-1]["content"][-1]["text"], completion=t, reward=float(r))
                                             for i, m, t, r in zip(ids, messages, texts, local_rewards.nan_to_num(0) @ reward_weights)]))
        # DAPO normalises by the completion tokens of the whole optimizer step, on all processes.
        step_tokens = accelerator.reduce(torch.stack([b["completion_mask"].sum() for b in buffer]).sum().float(), "sum")

        # ---- 4. mu optimisation passes over this round's completions ----
        policy.train()
        for _ in range(mu):
            step_loss, step_stats = 0.0, []
            for mb in buffer:
                t0 = time.perf_counter()
                with accelerator.accumulate(policy):
                    logps = policy(mb["batch"], mb["completion_ids"], mb["completion_mask"], cfg.temperature,
                                   prompt_index=mb["prompt_index"])
                    old = mb["old_logps"] if mb["old_logps"] is not None else logps.detach()
                    loss_kw = dict(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, ref_logps=mb["ref_logps"],
                                   loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
                                   max_completion_length=cfg.max_completion_length, num_items_in_batch=step_tokens,
                                   num_processes=world)
                    # accelerate divides by GA; dapo's normaliser already spans the whole step
                    scale = 1.0 if cfg.loss_type == "dapo" else 1.0 / GA
                    if cfg.use_pcgrad:
                        losses = [w * clipped_policy_loss(logps, old, mb["advantages"][:, j], mb["completion_mask"],
                                                          beta=0.0, **loss_kw)[0] for j, w in enumerate(reward_weights.tolist())]
                        kl_loss, stats = clipped_policy_loss(logps, logps.detach(), torch.zeros_like(mb["advantages"][:, 0]),
                                                             mb["completion_mask"], beta=cfg.beta, **loss_kw)
                        loss = sum(losses) + kl_loss
                        pcgrad_backward([l * scale for l in losses], policy.parameters(),
                                        extra_loss=kl_loss * scale if cfg.beta else None)
                        if accelerator.sync_gradients and world > 1:  # autograd.grad bypasses DDP's all-reduce
                            for p in policy.parameters():
                                if p.grad is not None:
                                    p.grad = accelerator.reduce(p.grad, "mean")
                    else:
                        loss, stats = clipped_policy_loss(logps, old, mb["advantages"], mb["completion_mask"],
                                                          beta=cfg.beta, **loss_kw)
                        accelerator.backward(loss * GA if cfg.loss_type == "dapo" else loss)
                    if accelerator.sync_gradients and cfg.max_grad_norm:
                        accelerator.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                timings["backward"] += time.perf_counter() - t0
                step_loss += loss.detach() if cfg.loss_type == "dapo" else loss.detach() / GA
                step_stats.append(stats)
            scheduler.step()
            global_step += 1

            # ---- 5. log ----
            if global_step % cfg.logging_steps == 0 or global_step == max_steps:
                rewards = torch.cat([s["rewards"] for s in round_stats])
                weighted = (rewards.nan_to_num(0.0) * reward_weights).sum(-1)
                metrics = {
                    "loss": accelerator.reduce(step_loss, "mean").item(),
                    "reward": weighted.mean().item(),
                    "reward_std": weighted.view(-1, G).std(-1).mean().item() if G > 1 else 0.0,
                    "kl": accelerator.reduce(sum(s["kl"] for s in step_stats) / len(step_stats), "mean").item(),
                    "clip_ratio": accelerator.reduce(sum(s["clip_ratio"] for s in step_stats) / len(step_stats), "mean").item(),
                    "completion_length": torch.cat([s["lengths"] for s in round_stats]).mean().item(),
                    "learning_rate": scheduler.get_last_lr()[0],
                    "step_time": time.perf_counter() - round_start,
                    **{f"time/{k}": v for k, v in timings.items()},
                }
                for j, name in enumerate(cfg.reward_funcs):
                    col = rewards[:, j]
                    metrics[f"rewards/{name}"] = col[~col.isnan()].mean().item() if (~col.isnan()).any() else float("nan")
                logger.log(global_step, metrics)
                logger.log_completions(global_step, [s for st in round_stats for s in st["samples"]][: cfg.log_completions])

            # ---- 6. checkpoint (atomic) and push ----
            if global_step % cfg.save_steps == 0 or global_step == max_steps:
                state = dict(global_step=global_step, round_index=round_index + 1, sampler=sampler.state_dict(),
                             stage=sampler.names[sampler.stage(global_step - 1)],
                             difficulty_levels=levels if cfg.curriculum else None, heldout_before=heldout_before)
                path = save_checkpoint(accelerator, cfg.output_dir, global_step, model=policy, processor=processor,
                                       extra_state=state, save_total_limit=cfg.save_total_limit)
                if uploader:
                    uploader.push(path, recipe=config_to_dict(cfg), metrics=logger.last_metrics, base_model=model_path,
                                  script="train_grpo.py")
            if global_step >= max_steps:
                break
        round_index += 1

    train_runtime = time.perf_counter() - train_start
    summary = dict(global_step=global_step, train_runtime=train_runtime, peak_memory_mb=peak_memory_mb(),
                   **(logger.last_metrics or {}))
    if eval_set is not None:
        after = evaluate()
        logger.log(global_step, {f"heldout_{k}": v for k, v in after.items()})
        summary.update({f"heldout_{k}_after": v for k, v in after.items()})
        if heldout_before:
            summary.update({f"heldout_{k}_before": v for k, v in heldout_before.items()})
        accelerator.print(f"held-out accuracy: before {heldout_before['accuracy']:.3f} -> after {after['accuracy']:.3f} "
                          f"({after['samples']} questions)" if heldout_before else
                          f"held-out accuracy after GRPO: {after['accuracy']:.3f} ({after['samples']} questions)")
    logger.close()
    if accelerator.is_main_process:
        plot_reward_curve(os.path.join(cfg.output_dir, "metrics.jsonl"), os.path.join(cfg.output_dir, "reward_curve.png"),
                          keys=["reward"] + [f"rewards/{n}" for n in cfg.reward_funcs])
        write_summary(cfg.output_dir, summary)
        if uploader:
            uploader.wait()
    accelerator.end_training()
    return policy


def difficulty_levels(cfg, dataset, policy, processor, accelerator, reward_fns, eos_ids, suppress_ids):
    """easy/medium/hard per training question: the data set's column, or estimated with the current model.

    The estimate is the error rate over --difficulty_samples sampled answers, scored by --difficulty_reward
    (a reward >= 1 counts as correct), optionally averaged with --rating_column; questions are shared out
    over the processes and the scores gathered, so every process builds the same stages.
    """
    if cfg.difficulty_samples == 0:
        if cfg.difficulty_column not in dataset.column_names:
            raise ValueError(f"--curriculum needs a '{cfg.difficulty_column}' column (--difficulty_column) or "
                             f"--difficulty_samples k to estimate difficulty; columns: {dataset.column_names}")
        levels = dataset[cfg.difficulty_column]
        bad = [(i, v) for i, v in enumerate(levels) if v not in ("easy", "medium", "hard")]
        if bad:
            raise ValueError(f"row {bad[0][0]}, column '{cfg.difficulty_column}': {bad[0][1]!r} is not easy/medium/hard")
        return list(levels)
    if cfg.difficulty_reward not in cfg.reward_funcs:
        raise ValueError(f"--difficulty_reward {cfg.difficulty_reward!r} must be one of --reward_funcs {cfg.reward_funcs}")
    judge = reward_fns[cfg.reward_funcs.index(cfg.difficulty_reward)]
    tokenizer = getattr(processor, "tokenizer", processor)
    rank, world, k = accelerator.process_index, accelerator.num_processes, cfg.difficulty_samples
    mine = list(range(rank, len(dataset), world))
    errors = {}
    policy.eval()
    chunk = max(1, cfg.per_device_train_batch_size // k)
    for start in range(0, len(mine), chunk):
        idx = mine[start:start + chunk]
        rows = [dataset[i] for i in idx for _ in range(k)]
        messages = [build_messages(r["question"], num_images=len(images_of(r)), choices=r.get("choices"),
                                   template=cfg.prompt_template, system_prompt=cfg.system_prompt) for r in rows]
        batch = encode_prompts(processor, messages, [images_of(r) for r in rows], sample_ids=[r["id"] for r in rows],
                               max_prompt_length=cfg.max_prompt_length).to(accelerator.device)
        seeds = completion_seeds(cfg.seed, -1, [i * k + j for i in idx for j in range(k)])
        with unwrap_for_generation(policy, accelerator) as unwrapped:
            ids, mask = generate_completions(unwrapped.model, batch, row_seeds=seeds, max_new_tokens=cfg.max_completion_length,
                                             temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                             eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                                             suppress_token_ids=suppress_ids)
        texts = tokenizer.batch_decode(ids.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)
        columns = {c: [r[c] for r in rows] for c in dataset.column_names if c != "image"}
        scores = judge(texts, **columns)
        for n, i in enumerate(idx):
            correct = [s is not None and s >= 1.0 for s in scores[n * k:(n + 1) * k]]
            errors[i] = 1.0 - sum(correct) / k
    gathered = {}
    for part in gather_object([errors]):
        gathered.update(part)
    error_rates = [gathered[i] for i in range(len(dataset))]
    if cfg.rating_column:
        if cfg.rating_column not in dataset.column_names:
            raise ValueError(f"--rating_column {cfg.rating_column!r} is not a column; columns: {dataset.column_names}")
        error_rates = combine_with_rating(error_rates, dataset[cfg.rating_column])
    return levels_from_scores(error_rates, split=cfg.difficulty_split, thresholds=tuple(cfg.difficulty_thresholds))


if __name__ == "__main__":
    relaunch_multi_cpu_if_needed()
    # With no arguments, run the tiny CPU recipe.
    main(parse_config(GRPOConfig, sys.argv[1:] or ["--config", TINY_RECIPE]))
