"""GRPO for vision-language models (and text LLMs), in one readable script.

    accelerate launch train_grpo.py                                   # tiny CPU recipe
    accelerate launch train_grpo.py --config recipes/crystal_cpr.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml train_grpo.py --config ...

For each prompt q, sample G completions, score them with the reward functions (called as TRL calls them),
normalise the weighted reward within each group into advantages, and minimise the clipped surrogate (plus
an optional k3 KL to a frozen reference). docs/grpo.md has the formulas.
"""

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import gather_object
from transformers import TrainerState

from kernels import group_advantages
from rewards import get_reward
from tiny.cache import TINY_DATASET, TINY_MODEL, TINY_RECIPE, resolve_tiny
from utils.core.checkpoint import save_checkpoint
from utils.core.compiled_generation import CACHE_IMPLEMENTATIONS, CompiledRollout, resolve_cache_implementation
from utils.core.config import ConfigError, choice, config_to_dict, parse_config
from utils.core.curriculum import LEVELS, combine_with_rating, levels_from_scores, stage_indices
from utils.core.data import images_of, load_vqa
from utils.core.encoding import encode_prompts
from utils.core.errors import exit_on_bad_input
from utils.core.groups import choose_groups, dynamic_sampling, has_spread, weighted_rewards
from utils.core.importance import IS_MODES, importance_weights, mismatch_metrics, mismatch_stats
from utils.core.launch import relaunch_multi_cpu_if_needed
from utils.core.logprobs import CompletionLogProbs, can_share_prompts, prepare_reference_model
from utils.core.losses import (
    ENTROPY_THRESHOLD,
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
    accumulation_divisor,
    clipped_policy_loss,
    high_entropy_mask,
)
from utils.core.models import disable_dropout, load_model_and_processor, prepare_for_training
from utils.core.packing import resolve_padding_free
from utils.core.pcgrad import PCGradAccumulator
from utils.core.prompts import PROMPT_TEMPLATES, build_messages
from utils.core.reward_calls import RewardLog, as_conversation, call_rewards, check_reward_call
from utils.core.rollout import (
    check_no_logits_shaping,
    generate_completions,
    special_token_ids_to_suppress,
    stop_token_ids,
    truncated_completions,
)
from utils.core.run import (
    finish_run,
    make_accelerator,
    prepare_training,
    resume_run,
    seed_run,
    start_logging,
    train_summary,
)
from utils.core.samplers import CurriculumSampler
from utils.core.seeds import completion_seeds
from utils.core.video import budget_from_config, check_config_video_flags, row_clips, video_flag, videos_of
from utils.core.vllm_rollout import VLLMRollout, require_vllm
from utils.core.zero3 import clear_stale_zero3_gradients, unwrap_for_generation
from utils.eval.heldout import evaluate_policy, load_eval_set

SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    # model
    model_name_or_path: str = field(default=TINY_MODEL,
                                    metadata={"help": "hub name or folder; 'tiny' builds the tiny VLM"})
    dtype: str = choice("auto", "float32", "bfloat16", "float16", help="weights dtype when loading")
    attn_implementation: Optional[str] = None  # attention: sdpa, eager, flash_attention_2...; none: the model's default
    freeze_vision_tower: bool = False  # freeze the vision encoder, its LoRA too (its projector stays trainable)
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    padding_free: Optional[bool] = field(default=None, metadata={"help": (
        "training log-prob passes pack the step's sequences end to end without padding (TRL's flag); none: where "
        "the model allows it, true: required, false: padded")})
    bf16: bool = False  # bf16 mixed precision (accelerate autocast); vLLM loads bf16 too
    use_peft: bool = False  # train LoRA adapters instead of all weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha (updates scaled by alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA branch input (0 while --disable_dropout)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # modules LoRA wraps (or all-linear)
    disable_dropout: bool = field(default=True, metadata={
        "help": "every dropout rate 0 (LoRA's too), so log-probs agree between rollout and training; TRL's flag "
                "(its default is false: docs/grpo.md says why ours is true)"})
    max_pixels: Optional[int] = None  # max pixels per image (Qwen-style image processors); none: the processor's
    min_pixels: Optional[int] = None  # min pixels per image (Qwen-style image processors); none: the processor's
    max_anyres_num: Optional[int] = None  # max tiles per image (InternVL-style image processors); none: the processor's
    fps: Optional[float] = video_flag("fps")
    max_frames: Optional[int] = video_flag("max_frames")
    video_max_pixels: Optional[int] = video_flag("video_max_pixels")
    video_min_pixels: Optional[int] = video_flag("video_min_pixels")
    video_total_pixels: Optional[int] = video_flag("video_total_pixels")
    # data
    dataset_name: str = field(default=TINY_DATASET, metadata={
        "help": "hub name, save_to_disk folder or data file; 'synthetic:shapes' makes one"})
    dataset_split: str = "train"  # split of --dataset_name to train on
    image_column: Optional[str] = field(default="image", metadata={"help": "'none' for text-only data"})
    video_column: str = "video"  # column with each row's video(s), when present (docs/data.md)
    question_column: str = "question"  # column with the question text
    answer_column: str = "answer"  # column with the ground-truth answer
    steps_column: str = "reference_steps"  # column with the reference reasoning steps (needed by cpr, reasoning, spr)
    choices_column: Optional[str] = None  # column with answer options; none: 'choices', else 'options', row by row
    prompt_template: str = choice(*PROMPT_TEMPLATES)  # system prompt that asks for the answer format; plain: none
    system_prompt: Optional[str] = None  # replaces the template's system prompt
    # rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["format", "accuracy"], metadata={
        "help": "reward names, module:function paths, or reward models (a sequence classifier's folder or hub id)"})
    reward_weights: Optional[list[float]] = None  # one weight per reward function; none: all 1.0
    reward_kwargs: dict = field(default_factory=dict, metadata={"help": 'JSON, e.g. {"cpr": {"answer_weight": 0.6}}'})
    # GRPO
    num_generations: int = 8  # completions sampled per prompt (the group size G)
    per_device_train_batch_size: int = 8  # completions per process per micro-batch; times processes: a multiple of G
    gradient_accumulation_steps: int = 1  # micro-batches (each freshly generated) per optimizer step
    max_prompt_length: Optional[int] = 512  # max prompt tokens, images included (longer: an error); none: no limit
    max_completion_length: int = 512  # max tokens generated per completion (also dr_grpo's normaliser); TRL's default
    temperature: float = 1.0  # sampling temperature; training log-probs use it too
    top_p: float = 1.0  # nucleus sampling of rollouts; 1.0: off
    top_k: Optional[int] = None  # top-k sampling of rollouts; none: off
    beta: float = 0.0  # weight of the k3 KL to the reference; 0 loads no reference model
    epsilon: float = 0.2  # lower clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # upper clip range (DAPO clip-higher); none: same as --epsilon
    loss_type: str = field(default="dapo", metadata={"choices": list(LOSS_TYPES), "help": (
        "normaliser: seq length, batch tokens, B*max_completion_length, step tokens (TRL's default dapo)")})
    importance_sampling_level: str = choice(*IMPORTANCE_LEVELS)  # importance ratio per token, or per sequence (GSPO)
    scale_rewards: str = choice(*SCALES)  # advantages / std of the group, of the batch, or not scaled
    num_iterations: int = 1  # optimisation passes (mu) over each round of generations
    mask_truncated_completions: bool = False  # completions cut at --max_completion_length stay out of the loss (DAPO)
    entropy_coef: float = field(default=0.0, metadata={"help": (
        "entropy bonus: the loss minus coef * the mean per-token policy entropy (TRL's flag); 0: off")})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": (
        "train the surrogate only on the top-q fraction of completion tokens by entropy (TRL's flag; the 80/20 "
        "paper uses 0.2); 1.0: every token")})
    entropy_threshold: float = field(default=ENTROPY_THRESHOLD, metadata={"help": (
        "entropy (nats) above which a token counts in the logged entropy_high_frac")})
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: drop groups whose rewards do not vary and refill the step with groups of new prompts"})
    max_resample_rounds: int = 4  # extra generation rounds a step may run to refill it under --dynamic_sampling
    use_vllm: bool = False  # generate rollouts with a colocated vLLM engine (CUDA only)
    cache_implementation: str = choice(*CACHE_IMPLEMENTATIONS, help=(
        "HF rollout's KV cache (TRL's flag): dynamic is generate's eager decoding, static also compiles the decode "
        "step (CUDA graphs on a GPU), auto is static on CUDA where it can run and dynamic elsewhere"))
    use_pcgrad: bool = field(default=False, metadata={"help": "one loss per reward, gradients combined with PCGrad"})
    allow_double_accuracy: bool = field(default=False,
                                        metadata={"help": "allow accuracy next to cpr (counts the answer twice)"})
    # vLLM engine (with --use_vllm; docs/distributed.md)
    vllm_gpu_memory_utilization: float = 0.3  # share of the GPU's memory vLLM may take (weights, activations, KV)
    vllm_max_num_seqs: Optional[int] = None  # most sequences per engine step; none: vLLM's default
    vllm_max_num_batched_tokens: Optional[int] = 4096  # tokens per engine step (TRL's value); none: vLLM's default
    vllm_max_model_len: Optional[int] = None  # context window; none: --max_prompt_length + --max_completion_length
    vllm_enable_sleep_mode: bool = False  # free the engine's memory (weights, KV cache) while training
    vllm_enforce_eager: bool = False  # no CUDA graphs: faster engine start, slower decoding
    vllm_importance_sampling_correction: bool = True  # weight the loss by pi_train / pi_vllm, truncated (TRL: on)
    vllm_importance_sampling_mode: str = choice(*IS_MODES, help=(
        "per-token or per-sequence ratio; truncate: cut at --vllm_importance_sampling_cap, mask: drop above it"))
    vllm_importance_sampling_cap: float = 3.0  # C, the largest importance weight kept (TRL's default)
    # difficulty curriculum (OpenVLThinker)
    curriculum: list[str] = field(default_factory=list, metadata={"help": "stages in order, e.g. medium,hard"})
    difficulty_column: str = "difficulty"  # column of easy/medium/hard labels (with --difficulty_samples 0)
    difficulty_samples: int = field(default=0, metadata={
        "help": "k rollouts per question to estimate difficulty; 0: use --difficulty_column"})
    difficulty_reward: str = "accuracy"  # reward that grades the --difficulty_samples rollouts (>= 1: correct)
    rating_column: Optional[str] = field(default=None,
                                         metadata={"help": "quality rating in [0, 1] averaged into the difficulty"})
    difficulty_split: str = choice("tertiles", "thresholds")  # error-rate tertiles, or cuts at --difficulty_thresholds
    difficulty_thresholds: list[float] = field(default_factory=lambda: [1 / 3, 2 / 3])  # score cuts: easy/medium/hard
    # optimisation
    learning_rate: float = 1e-6  # AdamW peak learning rate
    lr_scheduler_type: str = "constant"  # transformers LR schedule; constant ignores --warmup_ratio
    warmup_ratio: float = 0.0  # fraction of the steps with linear LR warmup
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the gradient norm to this; 0: no clipping
    max_steps: int = -1  # optimizer steps to run; <= 0: from --num_train_epochs
    num_train_epochs: float = 1.0  # passes over the data when --max_steps <= 0 (may be fractional)
    seed: int = 42  # seed of data order, rollout sampling and init
    cpu_threads: Optional[int] = field(default=None, metadata={
        "help": "torch threads per process without a GPU; default: the cores shared evenly between this machine's "
                "processes"})
    # run
    output_dir: str = "outputs/grpo"  # checkpoints, logs, metrics and config.yaml go here
    logging_steps: int = 1  # log metrics every N optimizer steps
    save_steps: int = 100  # checkpoint every N optimizer steps and at the end
    save_total_limit: Optional[int] = None  # keep the newest N checkpoints; none: keep all
    resume_from_checkpoint: Optional[str] = None  # checkpoint folder, or latest (newest in --output_dir); none: fresh
    report_to: str = "tensorboard"  # trackers: tensorboard, wandb, trackio, all or none (comma-separated)
    push_to_hub: bool = False  # upload every checkpoint to --hub_model_id (in the background)
    hub_model_id: Optional[str] = None  # Hub repository for --push_to_hub
    log_completions: bool = False  # write every completion of each logged step to completions.jsonl (TRL's flag)
    num_completions_to_print: Optional[int] = None  # with --log_completions, print this many per logged step; none: all
    # held-out evaluation (greedy accuracy), before and after training
    eval_dataset_name: Optional[str] = field(default=None,
                                             metadata={"help": "VQA set for held-out accuracy; none: no evaluation"})
    eval_split: str = "test"  # split of --eval_dataset_name
    eval_samples: Optional[int] = 256  # evaluate the first N questions; none: all
    eval_batch_size: int = 64  # prompts per generation batch in evaluation
    eval_max_new_tokens: int = 128  # max tokens per greedy evaluation answer
    eval_before: bool = field(default=True, metadata={"help": "also evaluate the starting model"})


def validate(cfg, num_processes, distributed_type="NO"):
    """Every flag combination that cannot work fails here, before a model is loaded (one line naming the flag)."""
    B, G = cfg.per_device_train_batch_size, cfg.num_generations
    for flag, value, options in (("--loss_type", cfg.loss_type, LOSS_TYPES),
                                 ("--scale_rewards", cfg.scale_rewards, SCALES),
                                 ("--importance_sampling_level", cfg.importance_sampling_level, IMPORTANCE_LEVELS)):
        if value not in options:
            raise ConfigError(f"{flag} {value!r} is not one of {', '.join(options)}")
    if B < 1:
        raise ConfigError(f"--per_device_train_batch_size {B} must be >= 1")
    if G < 2:
        raise ConfigError(f"--num_generations {G}: a group of one completion has no spread, so every advantage would "
                          "be 0 under every --scale_rewards; use 2 or more")
    if B * num_processes % G:
        raise ConfigError(f"--per_device_train_batch_size {B} x {num_processes} processes = {B * num_processes} "
                          f"completions is not a multiple of --num_generations {G}")
    if cfg.gradient_accumulation_steps < 1:
        raise ConfigError("--gradient_accumulation_steps must be >= 1")
    if cfg.num_iterations < 1:
        raise ConfigError("--num_iterations must be >= 1")
    check_config_video_flags(cfg)
    if cfg.max_completion_length < 1:
        raise ConfigError("--max_completion_length must be >= 1")
    if cfg.max_prompt_length is not None and cfg.max_prompt_length < 1:
        raise ConfigError("--max_prompt_length must be >= 1 or none")
    # floats are checked as `not ok`, so that nan is refused too
    if not cfg.temperature > 0:
        raise ConfigError("--temperature must be > 0 for GRPO sampling")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"--top_p {cfg.top_p} must be in (0, 1]")
    if cfg.top_k is not None and cfg.top_k < 0:
        raise ConfigError(f"--top_k {cfg.top_k} must be >= 0 (0 or none: off)")
    if not (cfg.epsilon >= 0 and (cfg.epsilon_high is None or cfg.epsilon_high >= 0)):
        raise ConfigError("--epsilon and --epsilon_high must be >= 0")
    if not cfg.beta >= 0:
        raise ConfigError(f"--beta {cfg.beta} must be >= 0")
    if not cfg.max_grad_norm >= 0:
        raise ConfigError("--max_grad_norm must be >= 0 (0: no clipping)")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ConfigError(f"--warmup_ratio {cfg.warmup_ratio} must be in [0, 1)")
    if not (cfg.max_steps > 0 or cfg.num_train_epochs > 0):
        raise ConfigError("--max_steps <= 0 needs --num_train_epochs > 0")
    if cfg.use_peft and not (cfg.lora_r >= 1 and 0 <= cfg.lora_dropout < 1):
        raise ConfigError("--use_peft needs --lora_r >= 1 and --lora_dropout in [0, 1)")
    if not cfg.reward_funcs:
        raise ConfigError("--reward_funcs is empty: give at least one reward")
    if len(set(cfg.reward_funcs)) != len(cfg.reward_funcs):
        raise ConfigError(f"--reward_funcs {cfg.reward_funcs} names a reward twice (its metrics would collide)")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(cfg.reward_funcs):
        raise ConfigError(f"--reward_weights has {len(cfg.reward_weights)} values for {len(cfg.reward_funcs)} "
                          "--reward_funcs")
    unknown = sorted(set(cfg.reward_kwargs) - set(cfg.reward_funcs))
    if unknown:
        raise ConfigError(f"--reward_kwargs names {unknown}, which are not in --reward_funcs {cfg.reward_funcs}")
    if "cpr" in cfg.reward_funcs and "accuracy" in cfg.reward_funcs and not cfg.allow_double_accuracy:
        raise ConfigError("--reward_funcs has both accuracy and cpr, and cpr already rewards the answer, so a correct "
                          "answer would count twice; drop accuracy, or pass --allow_double_accuracy to mean it")
    if cfg.use_pcgrad and distributed_type == "DEEPSPEED":
        raise ConfigError("--use_pcgrad needs per-objective gradients, which DeepSpeed does not expose; use DDP (or "
                          "one process)")
    if cfg.max_resample_rounds < 0:
        raise ConfigError("--max_resample_rounds must be >= 0")
    if not 0.0 <= cfg.top_entropy_quantile <= 1.0:
        raise ConfigError(f"--top_entropy_quantile {cfg.top_entropy_quantile} must be in [0, 1]")
    if cfg.use_pcgrad and not (cfg.entropy_coef == 0.0 and cfg.top_entropy_quantile == 1.0):
        raise ConfigError("--use_pcgrad projects one surrogate per reward; --entropy_coef and --top_entropy_quantile "
                          "< 1 act on the summed loss: use them without --use_pcgrad")
    bad_stages = [s for s in cfg.curriculum if s not in LEVELS]
    if bad_stages:
        raise ConfigError(f"--curriculum {bad_stages} are not difficulty levels ({', '.join(LEVELS)})")
    if cfg.difficulty_samples < 0:
        raise ConfigError("--difficulty_samples must be >= 0")
    if cfg.curriculum and cfg.difficulty_samples and cfg.difficulty_reward not in cfg.reward_funcs:
        raise ConfigError(f"--difficulty_reward {cfg.difficulty_reward!r} must be one of --reward_funcs "
                          f"{cfg.reward_funcs}")
    if not (len(cfg.difficulty_thresholds) == 2 and cfg.difficulty_thresholds[0] <= cfg.difficulty_thresholds[1]):
        raise ConfigError(f"--difficulty_thresholds {cfg.difficulty_thresholds} must be two increasing cuts")
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id")
    if cfg.save_steps < 1 or cfg.logging_steps < 1:
        raise ConfigError("--save_steps and --logging_steps must be >= 1")
    if cfg.num_iterations != 1 and cfg.save_steps % cfg.num_iterations:
        raise ConfigError(f"--save_steps {cfg.save_steps} must be a multiple of --num_iterations {cfg.num_iterations} "
                          "(checkpoints are taken between generation rounds)")
    if cfg.num_completions_to_print is not None and cfg.num_completions_to_print < 0:
        raise ConfigError("--num_completions_to_print must be >= 0 or none")
    if cfg.eval_samples is not None and cfg.eval_samples < 1:
        raise ConfigError("--eval_samples must be >= 1 or none")
    if cfg.eval_batch_size < 1:
        raise ConfigError("--eval_batch_size must be >= 1")
    if cfg.cpu_threads is not None and cfg.cpu_threads < 1:
        raise ConfigError(f"--cpu_threads {cfg.cpu_threads} must be >= 1")
    if not 0 < cfg.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization} must be in (0, 1]")
    for flag, value in (("--vllm_max_num_seqs", cfg.vllm_max_num_seqs),
                        ("--vllm_max_num_batched_tokens", cfg.vllm_max_num_batched_tokens),
                        ("--vllm_max_model_len", cfg.vllm_max_model_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1 or none")
    if cfg.vllm_importance_sampling_mode not in IS_MODES:
        raise ConfigError(f"--vllm_importance_sampling_mode {cfg.vllm_importance_sampling_mode!r} is not one of "
                          f"{', '.join(IS_MODES)}")
    if not cfg.vllm_importance_sampling_cap > 0:
        raise ConfigError(f"--vllm_importance_sampling_cap {cfg.vllm_importance_sampling_cap} must be > 0")
    if cfg.cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ConfigError(f"--cache_implementation {cfg.cache_implementation!r} is not one of "
                          f"{', '.join(CACHE_IMPLEMENTATIONS)}")
    if cfg.use_vllm and cfg.cache_implementation == "static":
        raise ConfigError("--cache_implementation static compiles the HF rollout, and --use_vllm generates with vLLM: "
                          "drop one")
    if cfg.use_vllm:
        require_vllm()

def build_rewards(cfg, columns):
    """The reward functions of --reward_funcs, each checked against TRL's call on these data set columns."""
    fns = []
    for name in cfg.reward_funcs:
        options = dict(cfg.reward_kwargs.get(name, {}))
        if name == "overlong_penalty":  # DAPO's punishment is relative to the generation budget
            options.setdefault("max_completion_length", cfg.max_completion_length)
        try:
            fn = get_reward(name, **options)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"--reward_funcs {name}: {e}") from None
        check_reward_call(fn, name, columns)
        fns.append(fn)
    return fns


def main(cfg: GRPOConfig):
    accelerator = make_accelerator(cfg, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                   mixed_precision="bf16" if cfg.bf16 else "no")
    validate(cfg, accelerator.num_processes, accelerator.distributed_type.name)
    seed_run(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    B, G = cfg.per_device_train_batch_size, cfg.num_generations
    GA, mu = cfg.gradient_accumulation_steps, cfg.num_iterations
    prompts_per_micro = B * world // G
    local = slice(rank * B, (rank + 1) * B)  # this process's completions of a micro-batch

    # ---- data and rewards (validated before any model is loaded) ----
    model_path, dataset_path = resolve_tiny(cfg, accelerator)
    needs_steps = any(name in ("cpr", "reasoning", "spr") for name in cfg.reward_funcs)
    dataset = load_vqa(dataset_path, split=cfg.dataset_split, image_column=cfg.image_column,
                       question_column=cfg.question_column, answer_column=cfg.answer_column,
                       steps_column=cfg.steps_column, choices_column=cfg.choices_column, require_steps=needs_steps,
                       video_column=cfg.video_column)
    reward_fns = build_rewards(cfg, dataset.column_names)
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_fns), dtype=torch.float32)
    eval_set = load_eval_set(cfg, accelerator)

    # ---- model, reference, optimiser ----
    model, processor = load_model_and_processor(model_path, dtype=cfg.dtype,
                                                attn_implementation=cfg.attn_implementation,
                                                freeze_vision_tower=cfg.freeze_vision_tower, max_pixels=cfg.max_pixels,
                                                min_pixels=cfg.min_pixels, max_anyres_num=cfg.max_anyres_num)
    tokenizer = getattr(processor, "tokenizer", processor)
    check_no_logits_shaping(model)  # before any compute: a sampler the log-probs cannot score
    model = prepare_for_training(model, cfg)
    if cfg.disable_dropout:
        disable_dropout(model)

    stop_ids = stop_token_ids(model, tokenizer)  # the same rule as evaluation and vLLM
    suppress_ids = special_token_ids_to_suppress(tokenizer, stop_ids)
    padding_free = resolve_padding_free(cfg.padding_free, model, accelerator.print)
    policy = CompletionLogProbs(model, padding_free=padding_free)
    rounds_per_epoch = math.ceil(len(dataset) / (prompts_per_micro * GA))
    max_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * rounds_per_epoch) * mu
    policy, optimizer, scheduler = prepare_training(
        accelerator, cfg, policy, [p for p in policy.parameters() if p.requires_grad], max_steps=max_steps,
        num_warmup_steps=math.ceil(cfg.warmup_ratio * max_steps), micro_batch_size=B)
    ref_policy = (prepare_reference_model(cfg, model_path, policy, accelerator, padding_free=padding_free)
                  if cfg.beta != 0.0 else None)
    if ref_policy is not None and cfg.disable_dropout:
        disable_dropout(ref_policy)
    # one colocated engine per process, fed the trainer's prompt ids and pixel budget (docs/distributed.md)
    max_videos = max((len(v) for v in dataset["videos"]), default=0) if "videos" in dataset.column_names else 0
    video_budget = budget_from_config(processor, cfg) if max_videos else None  # a model without video fails here
    vllm = (VLLMRollout(model_path, accelerator, cfg, processor=processor, model_config=model.config,
                        max_videos_per_prompt=max_videos, video_budget=video_budget) if cfg.use_vllm else None)
    # the HF rollout's static KV cache and compiled decode step, built once and reused
    # (utils/core/compiled_generation.py)
    plugin = accelerator.state.deepspeed_plugin
    compiled = CompiledRollout() if resolve_cache_implementation(
        cfg.cache_implementation, model, device=accelerator.device, use_vllm=cfg.use_vllm,
        zero3=plugin is not None and plugin.zero_stage == 3, notice=accelerator.print) else None
    # PCGrad projects the per-objective gradients of the whole step, averaged over processes (not DDP's hooks).
    pcgrad = PCGradAccumulator(policy.parameters(), len(reward_fns)) if cfg.use_pcgrad else None

    # ---- resume, then the (curriculum) sampler: difficulty levels are estimated once and checkpointed ----
    state, _ = resume_run(accelerator, cfg)
    global_step, round_index = state.get("global_step", 0), state.get("round_index", 0)
    stages = {"all": list(range(len(dataset)))}
    if cfg.curriculum:
        levels = state.get("difficulty_levels") or difficulty_levels(cfg, dataset, policy, processor, accelerator,
                                                                     reward_fns, stop_ids, suppress_ids)
        stages = stage_indices(levels, cfg.curriculum)
        accelerator.print("curriculum: " + ", ".join(f"{k} {len(v)} questions" for k, v in stages.items()))
    sampler = CurriculumSampler(stages, seed=cfg.seed, total_steps=max_steps)
    if state:
        sampler.load_state_dict(state["sampler"])
    logger, uploader = start_logging(accelerator, cfg, total_steps=max_steps, start_step=global_step)

    # the rollout's inputs that stay fixed for the run; each step adds its round, step, trainer state and logs
    rollout_inputs = dict(policy=policy, processor=processor, dataset=dataset, reward_fns=reward_fns, cfg=cfg,
                          accelerator=accelerator, stop_ids=stop_ids, suppress_ids=suppress_ids, vllm=vllm,
                          compiled=compiled)
    loss_divisor = accumulation_divisor(cfg.loss_type, GA)  # a micro-batch's loss / this = its share of the step

    heldout_before = state.get("heldout_before")
    if eval_set is not None and cfg.eval_before and global_step == 0:
        heldout_before = evaluate_policy(policy, processor, eval_set, cfg, accelerator,
                                         prompt_template=cfg.prompt_template)
        accelerator.print(f"held-out accuracy before GRPO: {heldout_before['accuracy']:.3f} "
                          f"({heldout_before['samples']} questions)")
    train_start = time.perf_counter()

    while global_step < max_steps:
        # ---- 1. rollout + rewards: GA micro-batches of B completions per process, G per prompt across processes ----
        round_start = time.perf_counter()
        timings = dict.fromkeys(("generation", "rewards", "logprob", "backward"), 0.0)
        trainer_state = TrainerState(global_step=global_step, max_steps=max_steps)
        reward_log = RewardLog()
        policy.eval()
        step_inputs = dict(rollout_inputs, round_index=round_index, step=global_step, trainer_state=trainer_state,
                           reward_log=reward_log, timings=timings)
        generated = [sample_micro_batch(sampler.take(prompts_per_micro, global_step), micro, **step_inputs)
                     for micro in range(GA)]
        # DAPO dynamic sampling: keep only groups whose rewards vary, and refill the step from new prompts
        sampling = {}
        if cfg.dynamic_sampling:
            groups, extra_rounds = dynamic_sampling(
                generated, lambda n, micro: sample_micro_batch(sampler.take(n, global_step), micro, **step_inputs),
                GA * prompts_per_micro, prompts_per_micro, G, world, reward_weights, cfg.use_pcgrad,
                cfg.max_resample_rounds)
            t0 = time.perf_counter()
            chosen = choose_groups(groups, GA * prompts_per_micro)
            batches = [rebuild_micro_batch(chosen[m * prompts_per_micro:(m + 1) * prompts_per_micro], policy,
                                           processor, dataset, cfg, accelerator) for m in range(GA)]
            timings["generation"] += time.perf_counter() - t0
            sampling = {"frac_zero_std_groups": 1.0 - sum(g["spread"] for g in groups) / len(groups),
                        "resample_rounds": extra_rounds, "generated_groups": len(groups)}
        else:
            batches = generated
        if vllm is not None:
            vllm.sleep()  # the engine's memory goes back to training (a no-op without --vllm_enable_sleep_mode)

        # ---- 2. advantages over whole groups (the gathered rewards), this process's slice ----
        t0 = time.perf_counter()
        for mb in batches:
            if cfg.use_pcgrad:  # one advantage per reward function, each normalised within its groups
                advantages = torch.stack([group_advantages(mb["rewards"][:, j], G, scale=cfg.scale_rewards)
                                          for j in range(len(reward_fns))], dim=-1)
            else:
                advantages = group_advantages(mb["rewards"], G, weights=reward_weights, scale=cfg.scale_rewards)
            mb["all_advantages"] = advantages
            mb["advantages"] = advantages[local].to(accelerator.device)
            mb["truncated"] = truncated_completions(mb["completion_ids"], mb["completion_mask"], stop_ids)
            mb["loss_mask"] = (mb["completion_mask"] * ~mb["truncated"][:, None] if cfg.mask_truncated_completions
                               else mb["completion_mask"])
        timings["rewards"] += time.perf_counter() - t0

        # ---- 3. log-probs that stay fixed for this round: behaviour policy (mu > 1) and reference ----
        t0 = time.perf_counter()
        with torch.no_grad():
            for mb in batches:
                mb["old_logps"] = (policy(mb["prompt_batch"], mb["completion_ids"], mb["completion_mask"],
                                          cfg.temperature, prompt_index=mb["prompt_index"]) if mu > 1 else None)
                mb["ref_logps"] = (ref_policy(mb["prompt_batch"], mb["completion_ids"], mb["completion_mask"],
                                              cfg.temperature, prompt_index=mb["prompt_index"]) if ref_policy else None)
        timings["logprob"] += time.perf_counter() - t0
        # DAPO normalises by the completion tokens of the whole optimizer step, on all processes.
        step_tokens = accelerator.reduce(torch.stack([b["loss_mask"].sum() for b in batches]).sum().float(), "sum")

        # ---- 4. mu optimisation passes over this round's completions ----
        policy.train()
        for _ in range(mu):
            step_loss, step_stats, grad_norm, vllm_stats = 0.0, [], None, []
            clear_stale_zero3_gradients(accelerator, policy)  # one optimizer step per pass (utils/core/zero3.py)
            for mb in batches:
                t0 = time.perf_counter()
                with accelerator.accumulate(policy):
                    # PCGrad takes its own gradients, so its forward skips the DDP wrapper
                    forward = accelerator.unwrap_model(policy) if pcgrad else policy
                    # the entropy comes from the same fused head pass (no extra vocabulary pass)
                    logps, entropy = forward(mb["prompt_batch"], mb["completion_ids"], mb["completion_mask"],
                                             cfg.temperature, return_entropy=True, prompt_index=mb["prompt_index"])
                    old = mb["old_logps"] if mb["old_logps"] is not None else logps.detach()
                    # vLLM sampled with its own kernels: truncated importance weights pi_old / pi_vllm per token
                    is_weights = None
                    if mb["sampler_logps"] is not None:
                        if cfg.vllm_importance_sampling_correction:
                            is_weights = importance_weights(old, mb["sampler_logps"], mb["completion_mask"],
                                                            mode=cfg.vllm_importance_sampling_mode,
                                                            cap=cfg.vllm_importance_sampling_cap)
                        vllm_stats.append(mismatch_stats(old, mb["sampler_logps"], mb["completion_mask"], is_weights))
                    loss_kw = dict(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, ref_logps=mb["ref_logps"],
                                   loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
                                   max_completion_length=cfg.max_completion_length, num_items_in_batch=step_tokens,
                                   num_processes=world, is_weights=is_weights, entropy=entropy,
                                   entropy_coef=cfg.entropy_coef, entropy_threshold=cfg.entropy_threshold,
                                   gradient_accumulation_steps=GA)
                    if cfg.top_entropy_quantile < 1.0:  # quantile over the micro-batch of every process (TRL)
                        loss_kw["entropy_mask"] = high_entropy_mask(entropy, mb["loss_mask"], cfg.top_entropy_quantile,
                                                                    gather=gather_padded(accelerator))
                    if pcgrad:
                        loss, stats = pcgrad_losses(pcgrad, logps, old, mb, reward_weights, cfg, 1.0 / loss_divisor,
                                                    **loss_kw)
                        if accelerator.sync_gradients:
                            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + global_step)
                            pcgrad.write_gradients(reduce=(lambda t: accelerator.reduce(t, "mean")) if world > 1
                                                   else None, generator=generator)
                    else:
                        loss, stats = clipped_policy_loss(logps, old, mb["advantages"], mb["loss_mask"],
                                                          beta=cfg.beta, **loss_kw)
                        # accelerate divides by GA: what reaches the gradients is the micro-batch's step share
                        accelerator.backward(loss * (GA / loss_divisor))
                    if accelerator.sync_gradients and cfg.max_grad_norm:
                        grad_norm = accelerator.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                timings["backward"] += time.perf_counter() - t0
                step_loss += loss.detach() / loss_divisor
                step_stats.append(stats)
            scheduler.step()
            global_step += 1

            # ---- 5. log ----
            if global_step % cfg.logging_steps == 0 or global_step == max_steps:
                metrics = step_metrics(batches, step_stats, step_loss, grad_norm, reward_weights, cfg, accelerator)
                metrics.update(sampling, **reward_log.metric_means())
                if vllm_stats:  # sums and maxima over the step's micro-batches, then over the processes
                    combined = {k: (torch.stack([st[k] for st in vllm_stats]).max() if k.endswith("max")
                                    else sum(st[k] for st in vllm_stats)) for k in vllm_stats[0]}
                    metrics.update(mismatch_metrics(combined, accelerator.reduce))
                metrics.update(learning_rate=scheduler.get_last_lr()[0], step_time=time.perf_counter() - round_start,
                               **{f"time/{k}": v for k, v in timings.items()})
                logger.log(global_step, metrics)
                if cfg.log_completions:
                    log_step_completions(logger, global_step, batches, reward_weights, cfg, accelerator)

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

    summary = train_summary(global_step, train_start, logger)
    if eval_set is not None:
        after = evaluate_policy(policy, processor, eval_set, cfg, accelerator, prompt_template=cfg.prompt_template)
        logger.log(global_step, {f"heldout_{k}": v for k, v in after.items()})
        summary.update({f"heldout_{k}_after": v for k, v in after.items()})
        if heldout_before:
            summary.update({f"heldout_{k}_before": v for k, v in heldout_before.items()})
        accelerator.print(
            f"held-out accuracy: before {heldout_before['accuracy']:.3f} -> after {after['accuracy']:.3f} "
            f"({after['samples']} questions)" if heldout_before else
            f"held-out accuracy after GRPO: {after['accuracy']:.3f} ({after['samples']} questions)")
    finish_run(accelerator, cfg, logger, uploader, summary,
               curves=[("reward_curve.png", ["reward"] + [f"rewards/{n}" for n in cfg.reward_funcs], 0.8)])
    return policy


def step_metrics(batches, step_stats, step_loss, grad_norm, reward_weights, cfg, accelerator):
    """What one optimizer step logs: rewards as TRL logs them (weighted, unscorable completions left out; per
    function), loss, KL, clipping, the largest importance-ratio deviation, the gradient norm before clipping and
    the completion length."""
    rewards = torch.cat([mb["rewards"] for mb in batches])
    weighted = weighted_rewards(rewards, reward_weights)
    scored = weighted[~weighted.isnan()]
    G = cfg.num_generations

    def mean_over_steps(key):
        return accelerator.reduce(sum(s[key] for s in step_stats) / len(step_stats), "mean").item()

    lengths = torch.cat([accelerator.gather(mb["completion_mask"].sum(-1)).float().cpu() for mb in batches])
    cut = torch.cat([accelerator.gather(mb["truncated"]).float().cpu() for mb in batches])
    metrics = {
        "loss": accelerator.reduce(step_loss, "mean").item(),
        "reward": scored.mean().item() if len(scored) else float("nan"),
        "reward_std": scored.std().item() if len(scored) > 1 else float("nan"),
        "frac_reward_zero_std": 1.0 - has_spread(rewards, reward_weights, G).float().mean().item(),
        "frac_unscorable": weighted.isnan().float().mean().item(),
        "kl": mean_over_steps("kl"),
        "entropy": mean_over_steps("entropy"),
        "entropy_high_frac": mean_over_steps("entropy_high_frac"),
        "clip_ratio": mean_over_steps("clip_ratio"),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "ratio_max_dev": accelerator.reduce(torch.stack([s["ratio_max_dev"] for s in step_stats]).max(), "max").item(),
        "completion_length": lengths.mean().item(),
        "completions/clipped_ratio": cut.mean().item(),
    }
    for j, name in enumerate(cfg.reward_funcs):
        values = rewards[:, j][~rewards[:, j].isnan()]
        metrics[f"rewards/{name}"] = values.mean().item() if len(values) else float("nan")
    return metrics


def gather_padded(accelerator):
    """1-D tensors of every process concatenated, each padded with -1 to the longest (None on one process)."""
    if accelerator.num_processes == 1:
        return None
    return lambda t: accelerator.gather(accelerator.pad_across_processes(t, dim=0, pad_index=-1))


def log_step_completions(logger, step, batches, reward_weights, cfg, accelerator):
    """Every completion of the step (all processes) to completions.jsonl, as TRL's completions table; a few to
    the console (--num_completions_to_print)."""
    rows = []
    for mb in batches:
        n = len(mb["ids"])
        mine = slice(accelerator.process_index * n, (accelerator.process_index + 1) * n)
        rewards = mb["rewards"][mine]
        weighted = weighted_rewards(rewards, reward_weights).tolist()
        for k, (sid, messages, text) in enumerate(zip(mb["ids"], mb["messages"], mb["texts"])):
            row = dict(id=sid, prompt=messages[-1]["content"][-1]["text"], completion=text,
                       reward=None if math.isnan(weighted[k]) else weighted[k],
                       advantage=mb["all_advantages"][mine][k].tolist(),
                       rewards={name: None if math.isnan(v) else v
                                for name, v in zip(cfg.reward_funcs, rewards[k].tolist())})
            row.update({column: values[k] for column, values in mb["extra"].items() if k < len(values)})
            rows.append(row)
    if accelerator.num_processes > 1:
        rows = gather_object(rows)
    logger.log_completions(step, rows)
    for row in rows[:cfg.num_completions_to_print]:
        accelerator.print(f"[step {step}] {row['id']} reward {row['reward']}: {row['completion'][:200]!r}")


def encode_rows(policy, processor, rows, cfg, accelerator, *, keys, sample_ids):
    """Chat messages and the encoded prompt batch of `rows` (rows with equal `keys` are the same prompt).

    When the model allows it, each distinct prompt is encoded once and its completions share its forward pass
    in training: `prompt_batch` then has one row per prompt and `prompt_index` maps completions to prompts
    (None otherwise)."""
    messages = [build_messages(r["question"], num_images=len(images_of(r)), choices=r.get("choices"),
                               template=cfg.prompt_template, system_prompt=cfg.system_prompt,
                               num_videos=len(videos_of(r))) for r in rows]
    unique = sorted(set(keys), key=keys.index)
    first = [keys.index(k) for k in unique]
    clips = row_clips(processor, rows, cfg)
    if can_share_prompts(accelerator.unwrap_model(policy).model, [len(images_of(rows[j])) for j in first],
                         [len(clips[j]) for j in first]):
        prompt_index = torch.tensor([unique.index(k) for k in keys], device=accelerator.device)
    else:
        prompt_index, first = None, list(range(len(rows)))
    prompt_batch = encode_prompts(processor, [messages[j] for j in first], [images_of(rows[j]) for j in first],
                                  sample_ids=[sample_ids[j] for j in first], max_prompt_length=cfg.max_prompt_length,
                                  videos=[clips[j] for j in first]).to(accelerator.device)
    return messages, prompt_batch, prompt_index


def rollout(policy, processor, rows, cfg, accelerator, *, keys, sample_ids, seeds, stop_ids, suppress_ids,
            vllm=None, step=0, compiled=None):
    """Sample one completion per row (rows with equal `keys` are the same prompt); see `encode_rows`. Where the
    prompts are shared, each is prefilled once in generation too, and its completions continue from its cache.
    `sampler_logps` [B, L] is vLLM's log-prob of each sampled token (None on the HF path)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    messages, prompt_batch, prompt_index = encode_rows(policy, processor, rows, cfg, accelerator, keys=keys,
                                                       sample_ids=sample_ids)
    sampler_logps = None
    if vllm is not None:  # the same prompt ids (shared rows too); vLLM's log-probs of the sampled tokens come back
        completion_ids, completion_mask, sampler_logps = vllm.generate(
            policy, processor, messages, [images_of(r) for r in rows], seeds, step=step, stop_ids=stop_ids,
            suppress_ids=suppress_ids, prompt_batch=prompt_batch, prompt_index=prompt_index, return_logprobs=True,
            videos=row_clips(processor, rows, cfg))
    else:
        generate = compiled.generate if compiled is not None else generate_completions  # --cache_implementation
        with unwrap_for_generation(policy, accelerator) as unwrapped:  # a group's prompt is prefilled once
            completion_ids, completion_mask = generate(
                unwrapped.model, prompt_batch, row_seeds=seeds, max_new_tokens=cfg.max_completion_length,
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id, suppress_token_ids=suppress_ids, prompt_index=prompt_index)
    texts = tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    return dict(prompt_batch=prompt_batch, prompt_index=prompt_index, completion_ids=completion_ids,
                completion_mask=completion_mask, texts=texts, messages=messages, sampler_logps=sampler_logps)


def sample_micro_batch(prompt_idx, micro, *, round_index, step, trainer_state, policy, processor, dataset,
                       reward_fns, cfg, accelerator, stop_ids, suppress_ids, vllm, reward_log, timings, compiled=None):
    """Rollout of micro-batch `micro` of round `round_index` (G completions per prompt, spread over the processes)
    and its rewards, gathered so that every process sees whole groups. A refill under --dynamic_sampling may hold
    fewer prompts than a full micro-batch (still a whole number of completions per process). The rewards' logged
    columns go to `reward_log`, the seconds spent to the step's `timings`."""
    G, B = cfg.num_generations, cfg.per_device_train_batch_size
    rank, world = accelerator.process_index, accelerator.num_processes
    global_rows = [i for i in prompt_idx for _ in range(G)]
    b = len(global_rows) // world  # completions per process: B, or fewer in a refill
    mine = slice(rank * b, (rank + 1) * b)
    rows = [dataset[i] for i in global_rows[mine]]
    ids = [str(r.get("id", i)) for r, i in zip(rows, global_rows[mine])]
    seeds = completion_seeds(cfg.seed, round_index,
                             range(micro * B * world + rank * b, micro * B * world + (rank + 1) * b))
    t0 = time.perf_counter()
    out = rollout(policy, processor, rows, cfg, accelerator, keys=global_rows[mine], sample_ids=ids, seeds=seeds,
                  stop_ids=stop_ids, suppress_ids=suppress_ids, vllm=vllm, step=step, compiled=compiled)
    timings["generation"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    token_ids = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
    columns = {c: [r[c] for r in rows] for c in dataset.column_names}
    before = {column: len(values) for column, values in reward_log.extra.items()}
    local_rewards = call_rewards(reward_fns, cfg.reward_funcs, prompts=out["messages"],
                                 completions=as_conversation(out["texts"]), completion_ids=token_ids,
                                 columns=columns, trainer_state=trainer_state, log=reward_log)
    mb = dict(out, rows=rows, ids=ids, keys=global_rows[mine], prompt_rows=list(prompt_idx), token_ids=token_ids,
              extra={k: v[before.get(k, 0):] for k, v in reward_log.extra.items()},
              rewards=accelerator.gather(local_rewards.to(accelerator.device)).cpu())
    if cfg.dynamic_sampling:  # groups may be regrouped across processes: every process needs every completion
        mb["all_token_ids"] = [t for part in gather_object([token_ids]) for t in part]
        if out["sampler_logps"] is not None:
            mine_logps = [lp[m.bool()].tolist() for lp, m in zip(out["sampler_logps"], out["completion_mask"])]
            mb["all_sampler_logps"] = [lp for part in gather_object([mine_logps]) for lp in part]
    timings["rewards"] += time.perf_counter() - t0
    return mb


def rebuild_micro_batch(groups, policy, processor, dataset, cfg, accelerator):
    """A micro-batch of kept groups (from any micro-batch, any process): this process re-encodes its prompts
    and takes its completions' token ids from the gathered ones."""
    G, B, rank = cfg.num_generations, cfg.per_device_train_batch_size, accelerator.process_index
    local = slice(rank * B, (rank + 1) * B)  # this process's completions of a micro-batch
    tokenizer = getattr(processor, "tokenizer", processor)
    global_rows = [g["prompt"] for g in groups for _ in range(G)]
    token_ids = [t for g in groups for t in g["token_ids"]][local]
    rows = [dataset[i] for i in global_rows[local]]
    ids = [str(r.get("id", i)) for r, i in zip(rows, global_rows[local])]
    messages, prompt_batch, prompt_index = encode_rows(policy, processor, rows, cfg, accelerator,
                                                       keys=global_rows[local], sample_ids=ids)
    width = max(len(t) for t in token_ids)
    completion_ids = torch.full((len(token_ids), width), tokenizer.pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for k, t in enumerate(token_ids):
        completion_ids[k, :len(t)] = torch.tensor(t, dtype=torch.long)
        completion_mask[k, :len(t)] = 1
    texts = tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    sampler_logps = None
    if groups[0]["sampler_logps"] is not None:  # vLLM's log-probs travel with their completions
        sampler_logps = torch.zeros(completion_ids.shape)
        for k, lp in enumerate([lp for g in groups for lp in g["sampler_logps"]][local]):
            sampler_logps[k, :len(lp)] = torch.tensor(lp)
        sampler_logps = sampler_logps.to(accelerator.device)
    return dict(prompt_batch=prompt_batch, prompt_index=prompt_index,
                completion_ids=completion_ids.to(accelerator.device),
                completion_mask=completion_mask.to(accelerator.device), texts=texts, messages=messages, rows=rows,
                ids=ids, keys=global_rows[local], token_ids=token_ids, extra={},
                rewards=torch.cat([g["rewards"] for g in groups]), sampler_logps=sampler_logps)


def pcgrad_losses(pcgrad, logps, old, mb, reward_weights, cfg, scale, **loss_kw):
    """One clipped surrogate per reward function (each with its own advantage), added to the step's PCGrad
    accumulator with the KL term as an unprojected extra. Returns (total loss, stats) like `clipped_policy_loss`;
    the stats are those of the weighted advantage sum."""
    weights = reward_weights.tolist()
    losses = [w * clipped_policy_loss(logps, old, mb["advantages"][:, j], mb["loss_mask"], beta=0.0, **loss_kw)[0]
              for j, w in enumerate(weights)]
    kl_loss = clipped_policy_loss(logps, logps.detach(), torch.zeros_like(mb["advantages"][:, 0]), mb["loss_mask"],
                                  beta=cfg.beta, **loss_kw)[0]
    pcgrad.add([loss * scale for loss in losses], extra_loss=kl_loss * scale if cfg.beta else None)
    with torch.no_grad():
        _, stats = clipped_policy_loss(logps.detach(), old, mb["advantages"] @ reward_weights.to(logps.device),
                                       mb["loss_mask"], beta=cfg.beta, **loss_kw)
    return sum(losses) + kl_loss, stats


def difficulty_levels(cfg, dataset, policy, processor, accelerator, reward_fns, stop_ids, suppress_ids):
    """easy/medium/hard per training question: the data set's column, or estimated with the current model.

    The estimate is the error rate over --difficulty_samples sampled answers (the training rollout), scored by
    --difficulty_reward (a reward >= 1 counts as correct), optionally averaged with --rating_column; questions
    are shared out over the processes and the scores gathered, so every process builds the same stages.
    """
    if cfg.difficulty_samples == 0:
        if cfg.difficulty_column not in dataset.column_names:
            raise ConfigError(f"--curriculum needs a '{cfg.difficulty_column}' column (--difficulty_column) or "
                              f"--difficulty_samples k to estimate difficulty; columns: {dataset.column_names}")
        levels = dataset[cfg.difficulty_column]
        bad = [(i, v) for i, v in enumerate(levels) if v not in LEVELS]
        if bad:
            raise ConfigError(f"row {bad[0][0]}, column '{cfg.difficulty_column}': {bad[0][1]!r} "
                              "is not easy/medium/hard")
        return list(levels)
    name = cfg.difficulty_reward
    judge = reward_fns[cfg.reward_funcs.index(name)]
    rank, world, k = accelerator.process_index, accelerator.num_processes, cfg.difficulty_samples
    mine = list(range(rank, len(dataset), world))
    errors = {}
    policy.eval()
    chunk = max(1, cfg.per_device_train_batch_size // k)
    for start in range(0, len(mine), chunk):
        idx = mine[start:start + chunk]
        keys = [i for i in idx for _ in range(k)]
        rows = [dataset[i] for i in keys]
        out = rollout(policy, processor, rows, cfg, accelerator, keys=keys, sample_ids=[r["id"] for r in rows],
                      seeds=completion_seeds(cfg.seed, -1, [i * k + j for i in idx for j in range(k)]),
                      stop_ids=stop_ids, suppress_ids=suppress_ids)
        token_ids = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
        scores = call_rewards([judge], [name], prompts=out["messages"], completions=as_conversation(out["texts"]),
                              completion_ids=token_ids, columns={c: [r[c] for r in rows] for c in dataset.column_names},
                              trainer_state=TrainerState(global_step=0))[:, 0]
        for n, i in enumerate(idx):
            errors[i] = 1.0 - float((scores[n * k:(n + 1) * k] >= 1.0).sum()) / k
    gathered = {}
    for part in gather_object([errors]):
        gathered.update(part)
    error_rates = [gathered[i] for i in range(len(dataset))]
    if cfg.rating_column:
        if cfg.rating_column not in dataset.column_names:
            raise ConfigError(f"--rating_column {cfg.rating_column!r} is not a column; columns: {dataset.column_names}")
        error_rates = combine_with_rating(error_rates, dataset[cfg.rating_column])
    return levels_from_scores(error_rates, split=cfg.difficulty_split, thresholds=tuple(cfg.difficulty_thresholds))


if __name__ == "__main__":
    relaunch_multi_cpu_if_needed()
    # With no arguments, run the tiny CPU recipe. Bad input (data, prompts, model paths) ends in one line.
    with exit_on_bad_input("train_grpo.py"):
        main(parse_config(GRPOConfig, sys.argv[1:] or ["--config", TINY_RECIPE]))
