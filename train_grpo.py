"""GRPO for vision-language models (and text LLMs), in one readable script.

    accelerate launch train_grpo.py                                   # tiny CPU recipe
    accelerate launch train_grpo.py --config recipes/crystal_cpr.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml train_grpo.py --config ...

For each prompt q, sample G completions, score them with the reward functions (called as TRL calls them),
normalise the weighted reward within each group into advantages, and minimise the clipped surrogate (plus
an optional k3 KL to a frozen reference). docs/grpo.md has the formulas.
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional

import torch
from accelerate.utils import gather_object
from safetensors.torch import load_file, save_file
from transformers import TrainerState

from kernels import group_advantages
from rewards import get_reward
from tiny.cache import TINY_DATASET, TINY_MODEL, TINY_RECIPE, resolve_tiny, tiny_recipe
from utils.core.checkpoint import CHECKPOINT_PREFIX, load_checkpoint, save_and_push
from utils.core.compiled_generation import CACHE_IMPLEMENTATIONS, CompiledRollout, resolve_cache_implementation
from utils.core.config import ConfigError, choice, parse_config
from utils.core.conversations import (
    load_prompt_set,
    prompt_images,
    prompt_messages,
    prompt_question,
    reward_columns,
    set_chat_template,
)
from utils.core.curriculum import LEVELS, combine_with_rating, levels_from_scores, stage_indices
from utils.core.data_sources import HubDatasetFlags, dataset_flags_error, train_rows, train_split
from utils.core.encoding import encode_prompts
from utils.core.errors import exit_on_bad_input
from utils.core.flags import CheckpointFlags, HeldOutFlags, ImageVideoFlags, ModelFlags
from utils.core.groups import choose_groups, dynamic_sampling, has_spread, weighted_rewards
from utils.core.guards import StepGuard
from utils.core.importance import IS_MODES, importance_weights, mismatch_metrics, mismatch_stats
from utils.core.launch import relaunch_multi_cpu_if_needed, watch_stage_parent
from utils.core.logprobs import CompletionLogProbs, can_share_prompts, prepare_reference_model
from utils.core.losses import (
    ENTROPY_THRESHOLD,
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
    accumulation_divisor,
    clipped_policy_loss,
    high_entropy_mask,
)
from utils.core.models import disable_dropout, load_model_and_processor, model_flags, prepare_for_training
from utils.core.optim import OptimizerFlags, check_optimizer_flags, num_warmup_steps
from utils.core.packing import resolve_padding_free
from utils.core.pcgrad import PCGradAccumulator
from utils.core.prompts import PROMPT_TEMPLATES
from utils.core.records import Record
from utils.core.ref_sync import ReferenceSync
from utils.core.reward_calls import RewardLog, as_conversation, call_rewards, check_reward_call
from utils.core.rollout import (
    check_no_logits_shaping,
    generate_completions,
    special_token_ids_to_suppress,
    stop_token_ids,
    truncated_completions,
)
from utils.core.run import finish_run, is_due, make_accelerator, prepare_training, resume_run, seed_run, start_logging
from utils.core.samplers import CurriculumSampler
from utils.core.seeds import completion_seeds
from utils.core.tool_formats import tool_format
from utils.core.tool_rollout import ToolRollout, context_limit, log_turns, tool_metrics
from utils.core.tools import ToolBox, pixel_budget
from utils.core.tracking import train_summary
from utils.core.trl_flags import TRL_ONLY_FLAGS
from utils.core.video import budget_from_config, check_config_video_flags, row_clips
from utils.core.vllm_flags import VLLM_MODES, check_vllm_flags
from utils.core.vllm_rollout import require_vllm
from utils.core.vllm_server_rollout import make_vllm_rollout
from utils.core.zero3 import clear_stale_zero3_gradients, is_zero3, unwrap_for_generation
from utils.eval.heldout import evaluate_after, evaluate_before, evaluate_policy, load_eval_set, load_val_set

SCALES = ("group", "batch", "none")
BEST_METRICS = ("accuracy", "format", "reasoning_agrees")  # the validation scores --metric_for_best_model may name


@dataclass
class GRPOConfig(HeldOutFlags, CheckpointFlags, ImageVideoFlags, ModelFlags, HubDatasetFlags, OptimizerFlags):
    """GRPO for vision-language models (and text LLMs). For each prompt, sample G completions (--num_generations),
    score them with the reward functions (called as TRL calls them), normalise the weighted reward within each group
    into advantages, and minimise the clipped surrogate (plus an optional k3 KL to a frozen reference). Flags
    override the recipe of --config; without one, the tiny CPU recipe (recipes/tiny_grpo.yaml) runs under the flags
    given, unless they name a model of their own. docs/grpo.md has the formulas, docs/flags.md every flag."""

    TRL_FLAGS: ClassVar[dict] = TRL_ONLY_FLAGS  # TRL's GRPOConfig flags read without fields of ours (trl_flags.py)
    RECIPE_FOLLOWERS: ClassVar[dict] = {"reward_funcs": ("reward_weights",)}  # the recipe's weights fit its rewards
    # model
    model_name_or_path: str = field(default=TINY_MODEL,
                                    metadata={"help": "hub name or folder; 'tiny' builds the tiny VLM"})
    padding_free: Optional[bool] = field(default=None, metadata={"help": (
        "training log-prob passes pack the step's sequences end to end without padding (TRL's flag); none: where "
        "the model allows it, true: required, false: padded")})
    bf16: bool = False  # bf16 mixed precision (accelerate autocast); vLLM loads bf16 too
    disable_dropout: bool = field(default=True, metadata={
        "help": "every dropout rate 0 (LoRA's too), so log-probs agree between rollout and training; TRL's flag "
                "(its default is false: docs/grpo.md says why ours is true)"})
    # data
    dataset_name: str = field(default=TINY_DATASET, metadata={
        "help": "hub name, save_to_disk folder or data file; 'synthetic:shapes' makes one"})
    dataset_split: Optional[str] = None  # alias of --dataset_train_split (TRL's name); none: that flag
    prompt_column: Optional[str] = field(default="prompt", metadata={"help": (
        "column of TRL-style prompts (chat messages with image/video parts, or text), used when the data set has it; "
        "without it the question/image columns build the prompt (docs/data.md); none: always those columns")})
    image_column: Optional[str] = field(default="image", metadata={"help": "'none' for text-only data"})
    video_column: str = "video"  # column with each row's video(s), when present (docs/data.md)
    question_column: str = "question"  # column with the question text
    answer_column: str = "answer"  # column with the ground-truth answer
    steps_column: str = "reference_steps"  # column with the reference reasoning steps (needed by cpr, reasoning, spr)
    choices_column: Optional[str] = None  # column with answer options; none: 'choices', else 'options', row by row
    prompt_template: str = choice(*PROMPT_TEMPLATES)  # system prompt that asks for the answer format; plain: none
    system_prompt: Optional[str] = None  # replaces the template's system prompt (a prompt column's: added if none)
    chat_template_path: Optional[str] = field(default=None, metadata={"help": (
        "a .jinja file or a tokenizer folder whose chat template replaces the model's (TRL's flag), e.g. one with a "
        "tool format; none: the model's own")})
    # generation
    num_generations: int = 8  # completions sampled per prompt (the group size G)
    steps_per_generation: Optional[int] = field(default=None, metadata={"help": (
        "micro-batches generated at once, a multiple of --gradient_accumulation_steps: one generation feeds "
        "steps_per_generation / gradient_accumulation_steps optimizer steps per --num_iterations pass (TRL's flag); "
        "none: --gradient_accumulation_steps, or from --generation_batch_size")})
    generation_batch_size: Optional[int] = field(default=None, metadata={"help": (
        "completions generated at once over all processes (TRL's flag): per_device_train_batch_size x processes x "
        "steps_per_generation; none: from --steps_per_generation")})
    max_prompt_length: Optional[int] = 512  # max prompt tokens, images included (longer: an error); none: no limit
    max_completion_length: int = 512  # max tokens generated per completion (also dr_grpo's normaliser); TRL's default
    temperature: float = 1.0  # sampling temperature; training log-probs use it too
    top_p: float = 1.0  # nucleus sampling of rollouts; 1.0: off
    top_k: Optional[int] = None  # top-k sampling of rollouts; none: off
    dynamic_sampling: bool = field(default=False, metadata={
        "help": "DAPO: drop groups whose rewards do not vary and refill the step with groups of new prompts"})
    max_resample_rounds: int = 4  # extra generation rounds a step may run to refill it under --dynamic_sampling
    use_vllm: bool = False  # generate rollouts with vLLM (CUDA only): colocated engines, or a server (--vllm_mode)
    cache_implementation: Optional[str] = choice(*CACHE_IMPLEMENTATIONS, help=(
        "HF rollout's KV cache (TRL's flag): dynamic is the eager decoding loop, static also compiles the decode "
        "step (CUDA graphs on a GPU), auto is static on CUDA where it can run and dynamic elsewhere; none: dynamic"))
    # generation: vLLM engine (with --use_vllm; docs/distributed.md)
    vllm_mode: str = choice(*VLLM_MODES, help=(
        "colocate: an engine inside every training process; server: a generation server on other GPUs "
        "(vllm serve / trl vllm-serve, or python vllm_serve.py), weights pushed after every optimizer step"))
    vllm_server_base_url: Optional[str] = None  # server mode: the server's URL; none: http://<host>:<port>
    vllm_server_host: str = "0.0.0.0"  # server mode: the server's host (TRL's default; give its address)
    vllm_server_port: int = 8000  # server mode: the server's HTTP port
    vllm_server_timeout: float = 240.0  # server mode: seconds to wait for the server to come up
    vllm_group_port: int = 51216  # server mode: port of the weight-update group's store (vllm serve: on the trainer)
    vllm_tensor_parallel_size: int = 1  # colocate mode: processes (GPUs) each engine is sharded over
    vllm_model_impl: str = choice("vllm", "transformers", help="colocate mode: vLLM's model code or transformers'")
    vllm_max_model_length: Optional[int] = None  # TRL's name for --vllm_max_model_len
    vllm_lora_sync: str = choice("auto", "adapter", "merge", help=(
        "with --use_peft: adapter sends only the LoRA adapter (a vLLM LoRA request), merge sends every adapted layer "
        "merged into its base weight; auto: adapter in colocate mode, merge for a server (its protocol has none)"))
    vllm_structured_outputs_regex: Optional[str] = field(default=None, metadata={"help": (
        "TRL's constrained decoding: refused, as the training log-probs would not apply the constraint")})
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
    # generation: tools (docs/tools.md)
    tools: list[str] = field(default_factory=list, metadata={"help": (
        "functions the policy may call while it answers: crop_image, zoom_image, rotate_image or module:function "
        "(TRL's tools); none: single-turn rollouts")})
    max_tool_calling_iterations: Optional[int] = None  # most rounds of tool calls per completion (TRL's); none: budget
    tool_timeout: float = 10.0  # seconds a tool call may run before the model is told it timed out
    # rewards
    reward_funcs: list[str] = field(default_factory=lambda: ["format", "accuracy"], metadata={
        "help": "reward names, module:function paths, or reward models (a sequence classifier's folder or hub id)"})
    reward_weights: Optional[list[float]] = None  # one weight per reward function; none: all 1.0
    reward_kwargs: dict = field(default_factory=dict, metadata={"help": 'JSON, e.g. {"cpr": {"answer_weight": 0.6}}'})
    allow_double_accuracy: bool = field(default=False,
                                        metadata={"help": "allow accuracy next to cpr (counts the answer twice)"})
    # GRPO loss
    beta: float = 0.0  # weight of the k3 KL to the reference; 0 loads no reference model
    use_bias_correction_kl: bool = field(default=False, metadata={"help": (
        "multiply the k3 KL by the importance ratio so its gradient is the unbiased reverse-KL gradient (TRL's flag "
        "and default, DeepSeek-V3.2); moves the KL gradient even on-policy")})
    sync_ref_model: bool = field(default=False, metadata={"help": (
        "TR-DPO: every --ref_model_sync_steps steps the reference becomes alpha x policy + (1 - alpha) x itself "
        "(TRL's flag; with LoRA the base gets reference adapters of its own, docs/grpo.md)")})
    ref_model_mixup_alpha: float = 0.6  # alpha of --sync_ref_model (TRL's default)
    ref_model_sync_steps: int = 512  # optimizer steps between reference syncs (TRL's default)
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
    use_pcgrad: bool = field(default=False, metadata={"help": "one loss per reward, gradients combined with PCGrad"})
    # data: difficulty curriculum (OpenVLThinker)
    curriculum: list[str] = field(default_factory=list, metadata={"help": "stages in order, e.g. medium,hard"})
    difficulty_column: str = "difficulty"  # column of easy/medium/hard labels (with --difficulty_samples 0)
    difficulty_samples: int = field(default=0, metadata={
        "help": "k rollouts per question to estimate difficulty; 0: use --difficulty_column"})
    difficulty_reward: str = "accuracy"  # reward that grades the --difficulty_samples rollouts (>= 1: correct)
    rating_column: Optional[str] = field(default=None,
                                         metadata={"help": "quality rating in [0, 1] averaged into the difficulty"})
    difficulty_split: str = choice("tertiles", "thresholds")  # error-rate tertiles, or cuts at --difficulty_thresholds
    difficulty_thresholds: list[float] = field(default_factory=lambda: [1 / 3, 2 / 3])  # score cuts: easy/medium/hard
    # training
    per_device_train_batch_size: int = 8  # completions per process per micro-batch; times processes: a multiple of G
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    learning_rate: float = 1e-6  # AdamW peak learning rate
    lr_scheduler_type: str = "constant"  # transformers LR schedule; constant ignores --warmup_ratio
    warmup_ratio: float = 0.0  # fraction of the steps with linear LR warmup
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the gradient norm to this; 0: no clipping
    max_steps: int = -1  # optimizer steps to run; <= 0: from --num_train_epochs
    num_train_epochs: float = 1.0  # passes over the data when --max_steps <= 0 (may be fractional)
    seed: int = 42  # seed of data order, rollout sampling and init
    # distributed
    cpu_threads: Optional[int] = field(default=None, metadata={
        "help": "torch threads per process without a GPU; default: the cores shared evenly between this machine's "
                "processes"})
    # logging
    output_dir: str = "outputs/grpo"  # checkpoints, logs, metrics and config.yaml go here
    logging_steps: int = 1  # log metrics every N optimizer steps
    report_to: str = "tensorboard"  # trackers: tensorboard, wandb, trackio, all or none (comma-separated)
    log_completions: bool = False  # write every completion of each logged step to completions.jsonl (TRL's flag)
    num_completions_to_print: Optional[int] = None  # with --log_completions, print this many per logged step; none: all
    # logging: held-out evaluation (greedy answer accuracy on VQA rows)
    eval_before: bool = field(default=True, metadata={"help": "also evaluate the starting model"})
    # logging: validation at each checkpoint, and the best one at the end
    val_split: Optional[str] = field(default=None, metadata={
        "help": "split of --eval_dataset_name (else --dataset_name) scored greedily at every checkpoint, before it is "
                "written (val_* metrics); none: no validation"})
    val_samples: Optional[int] = 256  # validate on the first N rows of --val_split; none: all
    load_best_model_at_end: bool = field(default=False, metadata={
        "help": "after the last step, load the checkpoint with the best --metric_for_best_model on --val_split (ties: "
                "the earliest) and run the held-out evaluation on it; train_summary.json names it "
                "(best_model_checkpoint) and --save_total_limit never deletes it (HF's flag)"})
    metric_for_best_model: Optional[str] = field(default=None, metadata={
        "help": f"the validation metric --load_best_model_at_end picks on, one of {', '.join(BEST_METRICS)}; higher is "
                "better (HF's flag); none: accuracy"})


def parse_args(argv=None):
    """The run's config: flags over --config's recipe, or over the tiny one (tiny.cache.tiny_recipe)."""
    return parse_config(GRPOConfig, argv, default_recipe=tiny_recipe(TINY_RECIPE, "model_name_or_path"))


def validate(cfg, num_processes, distributed_type="NO"):
    """Every flag combination that cannot work fails here, before a model is loaded (one line naming the flag)."""
    B, G = cfg.per_device_train_batch_size, cfg.num_generations  # as Layout reads them
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
    check_optimizer_flags(cfg)
    if dataset_flags_error(cfg):
        raise ConfigError(dataset_flags_error(cfg))
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
    if cfg.use_pcgrad and distributed_type in ("DEEPSPEED", "FSDP"):
        raise ConfigError("--use_pcgrad needs per-objective gradients, which DeepSpeed and FSDP do not expose; use DDP "
                          "(or one process)")
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
    steps_per_round = cfg.num_iterations * generation_steps(cfg, num_processes) // cfg.gradient_accumulation_steps
    if cfg.tools and cfg.save_steps % steps_per_round:
        raise ConfigError(f"--save_steps {cfg.save_steps} must be a multiple of the {steps_per_round} optimizer "
                          "steps each generation feeds (num_iterations x steps_per_generation / "
                          "gradient_accumulation_steps) with --tools: tool trajectories are not checkpointed, so "
                          "checkpoints fall between generations")
    if cfg.sync_ref_model and cfg.beta == 0.0:
        raise ConfigError("--sync_ref_model with --beta 0: there is no reference to sync (TRL refuses it too); set a "
                          "--beta > 0 or drop the flag")
    if not 0.0 <= cfg.ref_model_mixup_alpha <= 1.0:
        raise ConfigError(f"--ref_model_mixup_alpha {cfg.ref_model_mixup_alpha} must be in [0, 1]")
    if cfg.ref_model_sync_steps < 1:
        raise ConfigError(f"--ref_model_sync_steps {cfg.ref_model_sync_steps} must be >= 1")
    if cfg.num_completions_to_print is not None and cfg.num_completions_to_print < 0:
        raise ConfigError("--num_completions_to_print must be >= 0 or none")
    if cfg.eval_samples is not None and cfg.eval_samples < 1:
        raise ConfigError("--eval_samples must be >= 1 or none")
    if cfg.eval_batch_size < 1:
        raise ConfigError("--eval_batch_size must be >= 1")
    validation_error = val_flags_error(cfg)
    if validation_error:
        raise ConfigError(validation_error)
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
    if cfg.cache_implementation not in (None, *CACHE_IMPLEMENTATIONS):
        raise ConfigError(f"--cache_implementation {cfg.cache_implementation!r} is not one of "
                          f"{', '.join(CACHE_IMPLEMENTATIONS)}")
    if cfg.use_vllm and cfg.cache_implementation == "static":
        raise ConfigError("--cache_implementation static compiles the HF rollout, and --use_vllm generates with vLLM: "
                          "drop one")
    if check_vllm_flags(cfg, num_processes):
        require_vllm()
    validate_tools(cfg)


def generation_steps(cfg, num_processes):
    """Micro-batches generated at once (TRL's steps_per_generation), from --steps_per_generation or
    --generation_batch_size (completions over all processes); --gradient_accumulation_steps when neither is given.
    One generation feeds steps / gradient_accumulation_steps optimizer steps per --num_iterations pass, so it is a
    multiple of --gradient_accumulation_steps (TRL lets an optimizer step span two generations; here a generation
    ends with one). Fewer micro-batches than an optimizer step's, generated more often under one policy, sample what
    one generation of the whole step samples: with --num_iterations 1 that is read as the step's."""
    B, GA, mu = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.num_iterations
    S, size, per_micro = cfg.steps_per_generation, cfg.generation_batch_size, B * num_processes
    if size is not None:
        if size < 1 or size % per_micro:
            raise ConfigError(f"--generation_batch_size {size} is not a multiple of --per_device_train_batch_size {B} "
                              f"x {num_processes} processes = {per_micro}")
        if S is not None and S != size // per_micro:
            raise ConfigError(f"--generation_batch_size {size} and --steps_per_generation {S} disagree ({size} "
                              f"completions are {size // per_micro} micro-batches of {per_micro}); give one of them")
        S = size // per_micro
    S = GA if S is None else S
    if S < 1:
        raise ConfigError(f"--steps_per_generation {S} must be >= 1")
    if S < GA and GA % S == 0 and mu == 1:
        return GA
    if S % GA:
        raise ConfigError(f"--steps_per_generation {S} is not a multiple of --gradient_accumulation_steps {GA}: a "
                          f"generation must end with an optimizer step here"
                          f"{' (with --num_iterations 1 a divisor of it also runs)' if GA % S == 0 else ''}")
    return S


def val_flags_error(cfg):
    """The one-line reason the validation flags cannot run (--val_split, --val_samples, --load_best_model_at_end),
    or None. The validation rows must be neither the held-out rows nor the training rows."""
    if cfg.load_best_model_at_end and not cfg.val_split:
        return "--load_best_model_at_end picks on validation rows: give --val_split (a split never trained on)"
    if cfg.metric_for_best_model not in (None, *BEST_METRICS):
        return f"--metric_for_best_model {cfg.metric_for_best_model}: choose one of {', '.join(BEST_METRICS)}"
    if not cfg.val_split:
        return None
    if cfg.val_samples is not None and cfg.val_samples < 1:
        return "--val_samples must be >= 1 or none"
    name = cfg.eval_dataset_name or cfg.dataset_name
    heldout = cfg.eval_split if cfg.eval_dataset_name else cfg.dataset_test_split
    if cfg.val_split == heldout:
        return (f"--val_split {cfg.val_split} is the held-out split of {name}: a checkpoint picked on it would be "
                "scored on the rows that picked it; give another split")
    if name == cfg.dataset_name and cfg.val_split == train_split(cfg):
        return (f"--val_split {cfg.val_split} is the training split of {name}: validate on rows the run does not "
                "train on")
    return None


def validate_tools(cfg):
    """The tool flags: the bounds, and what the tool rollout does not combine with."""
    if not cfg.tools:
        if cfg.max_tool_calling_iterations is not None or cfg.tool_timeout != GRPOConfig.tool_timeout:
            raise ConfigError("--max_tool_calling_iterations and --tool_timeout apply to --tools, which is empty")
        return
    if cfg.max_tool_calling_iterations is not None and cfg.max_tool_calling_iterations < 0:
        raise ConfigError(f"--max_tool_calling_iterations {cfg.max_tool_calling_iterations} must be >= 0 or none")
    if not cfg.tool_timeout > 0:
        raise ConfigError(f"--tool_timeout {cfg.tool_timeout} must be > 0")
    if cfg.dynamic_sampling:
        raise ConfigError("--dynamic_sampling rebuilds micro-batches from token ids alone, and --tools trajectories "
                          "carry tool images and masks: drop one")
    ToolBox(cfg.tools, timeout=cfg.tool_timeout)  # each tool imports and has a schema

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


@dataclass(frozen=True)
class Layout:
    """Where a step's completions live: G per prompt, B per process in each of the step's GA micro-batches (a round
    generates S of them, S / GA steps' worth), so that the `world` processes together hold B x world completions of
    a micro-batch, a whole number of groups (`validate` checks it; a group may span processes). The one place G is
    read from the flags."""

    G: int  # completions per prompt (--num_generations)
    B: int  # completions per process per micro-batch (--per_device_train_batch_size)
    GA: int  # micro-batches per optimizer step (--gradient_accumulation_steps)
    S: int  # micro-batches per generation round (--steps_per_generation): S / GA optimizer steps per pass
    rank: int
    world: int

    @classmethod
    def of(cls, cfg, accelerator):
        return cls(cfg.num_generations, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                   generation_steps(cfg, accelerator.num_processes), accelerator.process_index,
                   accelerator.num_processes)

    @property
    def prompts_per_micro(self):
        return self.B * self.world // self.G

    @property
    def local(self):
        """This process's completions of a full micro-batch (the gathered rewards, the advantages)."""
        return slice(self.rank * self.B, (self.rank + 1) * self.B)


@dataclass
class MicroBatch(Record):
    """One micro-batch of a step as this process holds it: its share of the completions (B, or fewer in a
    --dynamic_sampling refill), G per prompt across the processes. The phases of the step fill it in order:
    sampling (`rollout`), scoring (`score_micro_batch`), the advantages (`add_advantages`) and the log-probs that stay
    fixed for the round (`add_fixed_logprobs`); the optimisation pass and the logs read it. [.] shapes: B completions
    of this process, L completion tokens."""

    # sampled: `rollout` (from `sample_micro_batch`, `rebuild_micro_batch` or the difficulty estimate)
    prompt_rows: list  # data set indices of the micro-batch's prompts, every process's (one per group)
    rows: list  # this process's data set rows, one per completion
    indices: list  # their data set indices (equal indices: the same prompt)
    ids: list  # their sample ids (errors, completions.jsonl)
    messages: list  # their chat messages
    prompt_batch: Any  # the encoded prompts: one row per completion, or per distinct prompt with prompt_index
    prompt_index: Optional[torch.Tensor]  # [B] each completion's row of prompt_batch; None: one row each
    completion_ids: torch.Tensor  # [B, L] the sampled tokens, right-padded
    completion_mask: torch.Tensor  # [B, L] 1 on sampled tokens
    texts: list  # the decoded completions
    token_ids: list  # each completion's tokens, unpadded
    completions: list  # TRL's completions for the rewards: [assistant message], or a tool trajectory's messages
    sampler_logps: Optional[torch.Tensor] = None  # [B, L] vLLM's log-prob of each sampled token; None: HF rollout
    # --tools (utils/core/tool_rollout.py): the completions are trajectories of model and tool tokens
    model_mask: Optional[torch.Tensor] = None  # [B, L] 1 on the model's own tokens; None: every token is
    completion_inputs: Optional[dict] = None  # the tool tokens' side inputs and images; None: no tool image
    tool_stats: Optional[dict] = None  # per completion: tool_calls, tool_errors, tool_timeouts, turns, tool_tokens
    tool_images: Optional[list] = None  # per completion, the images its tools returned
    tool_truncated: Optional[torch.Tensor] = None  # [B] cut by the budget or the context limit
    # scored: `score_micro_batch`
    rewards: Optional[torch.Tensor] = None  # [completions of every process, reward functions]; NaN: not scored
    extra: dict = field(default_factory=dict)  # the columns the rewards logged for these completions
    all_token_ids: Optional[list] = None  # every process's token_ids (--dynamic_sampling regroups completions)
    all_sampler_logps: Optional[list] = None  # every process's vLLM log-probs, unpadded (--dynamic_sampling)
    # advantages: `add_advantages`
    all_advantages: Optional[torch.Tensor] = None  # [completions of every process] ([.., rewards] under PCGrad)
    advantages: Optional[torch.Tensor] = None  # this process's rows of all_advantages, on the device
    truncated: Optional[torch.Tensor] = None  # [B] True where a completion was cut at --max_completion_length
    loss_mask: Optional[torch.Tensor] = None  # [B, L] completion_mask, less truncated completions with
    #                                            --mask_truncated_completions
    # fixed for the round: `add_fixed_logprobs`
    old_logps: Optional[torch.Tensor] = None  # [B, L] the behaviour policy's (--num_iterations > 1); None: detached
    ref_logps: Optional[torch.Tensor] = None  # [B, L] the reference model's (--beta != 0)
    # the first pass's log-probs, detached (--log_completions writes them beside the trajectories)
    policy_logps: Optional[torch.Tensor] = None

    def policy_inputs(self):
        """What a log-prob pass takes besides the prompts and completions: the shared-prompt index, and for tool
        trajectories the tool images and the tokens to score (the model's)."""
        if self.model_mask is None:
            return {"prompt_index": self.prompt_index}
        return {"prompt_index": self.prompt_index, "completion_inputs": self.completion_inputs,
                "label_mask": self.completion_mask * self.model_mask}

    @property
    def sampled_mask(self):
        """[B, L] the tokens the policy sampled: the completion's, less a trajectory's tool tokens."""
        return self.completion_mask if self.model_mask is None else self.completion_mask * self.model_mask


@dataclass
class Rollouts:
    """What sampling and scoring read, fixed for the run."""

    cfg: GRPOConfig
    accelerator: Any
    layout: Layout
    policy: Any  # the prepared CompletionLogProbs
    processor: Any
    dataset: Any
    reward_fns: list
    reward_weights: torch.Tensor  # [reward functions]
    stop_ids: list
    suppress_ids: list
    vllm: Optional[object] = None  # --use_vllm's engine: VLLMRollout (colocate) or VLLMServerRollout (server)
    compiled: Optional[CompiledRollout] = None  # --cache_implementation static's decode step
    tools: Optional[ToolRollout] = None  # --tools: the multi-turn loop (utils/core/tool_rollout.py)


@dataclass
class PassResult:
    """What one optimisation pass (one optimizer step) leaves for the log."""

    loss: Any  # the step's loss (this process)
    stats: list  # clipped_policy_loss's stats, one per micro-batch
    grad_norm: Optional[torch.Tensor]  # before clipping; None: not clipped
    vllm_stats: list  # the sampler mismatch per micro-batch (--use_vllm)
    stepped: bool = True  # False: the step guard skipped the optimizer step (a non-finite loss or gradient norm)


@contextlib.contextmanager
def timed(timings, key):
    """Add the seconds the block takes to timings[key] (the step's time/<key> metric)."""
    t0 = time.perf_counter()
    yield
    timings[key] += time.perf_counter() - t0


def main(cfg: GRPOConfig):
    accelerator = make_accelerator(cfg, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                   mixed_precision="bf16" if cfg.bf16 else "no")
    validate(cfg, accelerator.num_processes, accelerator.distributed_type.name)
    seed_run(cfg)
    layout, mu = Layout.of(cfg, accelerator), cfg.num_iterations

    # ---- data and rewards (validated before any model is loaded) ----
    model_path, dataset_path = resolve_tiny(cfg, accelerator)
    needs_steps = any(name in ("cpr", "reasoning", "spr") for name in cfg.reward_funcs)
    # TRL's prompt column when the data set has one, else the question/image columns (utils/core/conversations.py)
    # --dataset_streaming reads the prompts the run draws: its rounds x S micro-batches (x refills under DAPO)
    rounds = -(-max(cfg.max_steps, 1) // (mu * layout.S // layout.GA))
    streamed = rounds * layout.S * layout.prompts_per_micro * (1 + cfg.max_resample_rounds * cfg.dynamic_sampling)
    dataset = load_prompt_set(train_rows(cfg, dataset_path, rows=streamed), split=train_split(cfg),
                              prompt_column=cfg.prompt_column,
                              image_column=cfg.image_column, video_column=cfg.video_column,
                              question_column=cfg.question_column, answer_column=cfg.answer_column,
                              steps_column=cfg.steps_column, choices_column=cfg.choices_column,
                              require_steps=needs_steps)
    toolbox = ToolBox(cfg.tools, timeout=cfg.tool_timeout) if cfg.tools else None  # schemas checked here
    if toolbox and "videos" in dataset.column_names:
        raise ConfigError("--tools rolls out image and text prompts; this data set has videos")
    if toolbox and cfg.prompt_column in dataset.column_names and isinstance(dataset[0][cfg.prompt_column], str):
        raise ConfigError("--tools needs chat prompts (the tools are rendered by the chat template); this data set's "
                          f"'{cfg.prompt_column}' column holds plain text")
    # rewards get every column but the prompt, as TRL passes them, and tool_calls with --tools
    reward_fns = build_rewards(cfg, reward_columns(dataset.column_names, cfg.prompt_column)
                               + (["tool_calls"] if toolbox else []))
    reward_weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_fns), dtype=torch.float32)
    eval_set = load_eval_set(cfg, accelerator)
    val_set = load_val_set(cfg, accelerator)  # --val_split: scored at each checkpoint

    # ---- model, reference, optimiser ----
    model, processor = load_model_and_processor(model_path, **model_flags(cfg))
    tokenizer = getattr(processor, "tokenizer", processor)
    set_chat_template(processor, cfg.chat_template_path)
    check_no_logits_shaping(model)  # before any compute: a sampler the log-probs cannot score
    model = prepare_for_training(model, cfg)
    if cfg.disable_dropout:
        disable_dropout(model)

    stop_ids = stop_token_ids(model, tokenizer)  # the same rule as evaluation and vLLM
    suppress_ids = special_token_ids_to_suppress(tokenizer, stop_ids)
    tools = None
    if toolbox:  # the family's tool-call format from its chat template, or a refusal that says why
        toolbox.max_pixels = pixel_budget(processor)
        fmt = tool_format(processor, [tokenizer.decode([i]) for i in stop_ids], model_name=model_path)
        tools = ToolRollout(processor, toolbox, fmt, stop_ids=stop_ids, max_completion_length=cfg.max_completion_length,
                            max_iterations=cfg.max_tool_calling_iterations, context_limit=context_limit(model, cfg),
                            model_type=model.config.model_type)
    padding_free = resolve_padding_free(cfg.padding_free, model, accelerator.print)
    policy = CompletionLogProbs(model, padding_free=padding_free)
    # a round generates S micro-batches; each --num_iterations pass over them is S / GA optimizer steps
    steps_per_pass = layout.S // layout.GA
    rounds_per_epoch = math.ceil(len(dataset) / (layout.prompts_per_micro * layout.S))
    max_steps = (cfg.max_steps if cfg.max_steps > 0
                 else math.ceil(cfg.num_train_epochs * rounds_per_epoch) * mu * steps_per_pass)
    policy, optimizer, scheduler = prepare_training(
        accelerator, cfg, policy, [p for p in policy.parameters() if p.requires_grad], max_steps=max_steps,
        num_warmup_steps=num_warmup_steps(cfg, max_steps), micro_batch_size=layout.B)
    ref_policy = (prepare_reference_model(cfg, model_path, policy, accelerator, padding_free=padding_free)
                  if cfg.beta != 0.0 else None)
    if ref_policy is not None and cfg.disable_dropout:
        disable_dropout(ref_policy)
    # TR-DPO: the reference mixed toward the policy every --ref_model_sync_steps (utils/core/ref_sync.py)
    ref_sync = (ReferenceSync(accelerator, policy, ref_policy, alpha=cfg.ref_model_mixup_alpha,
                              sync_steps=cfg.ref_model_sync_steps) if cfg.sync_ref_model else None)
    # colocated engines fed the trainer's prompt ids and pixel budget, or a server (docs/distributed.md)
    max_videos = max((len(v) for v in dataset["videos"]), default=0) if "videos" in dataset.column_names else 0
    video_budget = budget_from_config(processor, cfg) if max_videos else None  # a model without video fails here
    vllm = (make_vllm_rollout(model_path, accelerator, cfg, processor=processor, model_config=model.config,
                              max_videos_per_prompt=max_videos, video_budget=video_budget) if cfg.use_vllm else None)
    # the HF rollout's static KV cache and compiled decode step, built once and reused
    # (utils/core/compiled_generation.py)
    compiled = CompiledRollout() if resolve_cache_implementation(
        cfg.cache_implementation, model, device=accelerator.device, use_vllm=cfg.use_vllm,
        zero3=is_zero3(accelerator, policy) or accelerator.distributed_type.name == "FSDP",
        notice=accelerator.print) else None
    # PCGrad projects the per-objective gradients of the whole step, averaged over processes (not DDP's hooks).
    pcgrad = PCGradAccumulator(policy.parameters(), len(reward_fns)) if cfg.use_pcgrad else None
    ro = Rollouts(cfg=cfg, accelerator=accelerator, layout=layout, policy=policy, processor=processor,
                  dataset=dataset, reward_fns=reward_fns, reward_weights=reward_weights, stop_ids=stop_ids,
                  suppress_ids=suppress_ids, vllm=vllm, compiled=compiled, tools=tools)

    # ---- resume, then the (curriculum) sampler: difficulty levels are estimated once and checkpointed ----
    state, resume_path = resume_run(accelerator, cfg)
    global_step, round_index = state.get("global_step", 0), state.get("round_index", 0)
    if ref_sync is not None and resume_path:
        ref_sync.load_state_tensors(read_tensors(resume_path, REFERENCE_FILE))
    # a checkpoint taken inside a round holds the rest of it: resume there (`round_state`)
    pending = restore_round(ro, resume_path, state["round"]) if state.get("round") else None
    guard = StepGuard(accelerator, cfg.max_skipped_steps)  # no optimizer step from a NaN or inf (utils/core/guards.py)
    guard.load_state_dict(state.get("guard"))
    best = state.get("best")  # --val_split: the best checkpoint so far (`better_checkpoint`)
    stages, levels = {"all": list(range(len(dataset)))}, None
    if cfg.curriculum:
        levels = state.get("difficulty_levels") or difficulty_levels(ro)
        stages = stage_indices(levels, cfg.curriculum)
        accelerator.print("curriculum: " + ", ".join(f"{k} {len(v)} questions" for k, v in stages.items()))
    sampler = CurriculumSampler(stages, seed=cfg.seed, total_steps=max_steps)
    if state:
        sampler.load_state_dict(state["sampler"])
    logger, uploader = start_logging(accelerator, cfg, total_steps=max_steps, start_step=global_step)
    loss_divisor = accumulation_divisor(cfg.loss_type, layout.GA)  # a micro-batch's loss / this = its step share

    def evaluate(tag):  # greedy held-out accuracy; the trained model's is logged
        result = evaluate_policy(policy, processor, eval_set, cfg, accelerator, prompt_template=cfg.prompt_template,
                                 tools=tools)
        if tag == "after":
            logger.log(global_step, {f"heldout_{k}": v for k, v in result.items()})
        return result

    def validate_checkpoint(best):  # --val_split: greedy scores logged as val_<key> at this step; the best so far
        if val_set is None:
            return best
        result = evaluate_policy(policy, processor, val_set, cfg, accelerator, prompt_template=cfg.prompt_template,
                                 tools=tools, max_samples=cfg.val_samples or len(val_set))
        logger.log(global_step, {f"val_{k}": v for k, v in result.items()})
        return better_checkpoint(best, result, cfg, global_step, accelerator.print)

    heldout_before = evaluate_before(
        accelerator, evaluate if eval_set is not None else None, state, cfg, global_step,
        describe=lambda r: f"held-out accuracy before GRPO: {r['accuracy']:.3f} ({r['samples']} questions)")
    train_start = time.perf_counter()

    while global_step < max_steps:
        round_start = time.perf_counter()
        timings = dict.fromkeys(("generation", "rewards", "logprob", "backward"), 0.0)
        reward_log = RewardLog()
        if pending is not None:  # the rest of the round a checkpoint was taken in
            batches, sampling, start = pending["batches"], pending["sampling"], pending["position"]
            reward_log.metrics, pending = pending["reward_metrics"], None
        else:
            # ---- 1-2. sample and score the round: S micro-batches of B completions per process ----
            batches, sampling = sample_round(ro, sampler, step=global_step, round_index=round_index,
                                             trainer_state=TrainerState(global_step=global_step, max_steps=max_steps),
                                             reward_log=reward_log, timings=timings)
            if vllm is not None:
                vllm.sleep()  # the engine's memory goes back to training (a no-op without --vllm_enable_sleep_mode)
            # ---- 3. advantages over whole groups (the gathered rewards), this process's slice ----
            with timed(timings, "rewards"):
                add_advantages(ro, *batches)
            # ---- 4. log-probs that stay fixed for this round: behaviour policy (when it moves) and reference ----
            with timed(timings, "logprob"):
                add_fixed_logprobs(policy, ref_policy, cfg, batches, behaviour=mu * steps_per_pass > 1)
            start = 0

        # ---- 5. mu passes over this round's completions, each S / GA optimizer steps of GA micro-batches ----
        policy.train()
        for position in range(start, mu * steps_per_pass):
            chunk = batches[(position % steps_per_pass) * layout.GA:][:layout.GA]
            # DAPO normalises by the completion tokens of the whole optimizer step, on all processes.
            step_tokens = accelerator.reduce(torch.stack([b.loss_mask.sum() for b in chunk]).sum().float(), "sum")
            result = optimisation_pass(ro, chunk, optimizer=optimizer, pcgrad=pcgrad, step_tokens=step_tokens,
                                       loss_divisor=loss_divisor, step=global_step, timings=timings, guard=guard)
            if result.stepped:
                scheduler.step()
            global_step += 1
            if ref_sync is not None:
                ref_sync.after_step(global_step)
            if vllm is not None:  # server mode: the new weights go to the server now (colocate: before the next round)
                vllm.sync_after_step(policy, global_step)
            # ---- 6. log, checkpoint (atomic) and push ----
            if is_due(global_step, cfg.logging_steps, max_steps):
                log_step(ro, logger, global_step, chunk, result, sampling=sampling, reward_log=reward_log,
                         learning_rate=scheduler.get_last_lr()[0], step_time=time.perf_counter() - round_start,
                         timings=timings, skipped_steps=guard.skipped_steps)
            if is_due(global_step, cfg.save_steps, max_steps):
                best = validate_checkpoint(best)  # before the checkpoint is written, which records the best so far
                inside = position + 1 < mu * steps_per_pass  # the round goes on after this step
                state = dict(global_step=global_step, round_index=round_index + (not inside),
                             sampler=sampler.state_dict(), stage=sampler.names[sampler.stage(global_step - 1)],
                             difficulty_levels=levels, heldout_before=heldout_before, guard=guard.state_dict(),
                             best=best)
                saves = round_saves(ro, state, batches, position + 1 if inside else None, reward_log, sampling,
                                    ref_sync)
                save_and_push(accelerator, cfg, global_step, model=policy, processor=processor, state=state,
                              logger=logger, uploader=uploader, base_model=model_path, script="train_grpo.py",
                              extra_saves=saves, keep=[best["checkpoint"]] if best else [])
            if global_step >= max_steps:
                break
        round_index += 1

    if cfg.load_best_model_at_end and best and best["step"] != global_step:
        load_checkpoint(accelerator, best["checkpoint"])  # its weights into the policy, as a resume loads them
        accelerator.print(f"loaded the best checkpoint on validation {best['metric']}: {best['checkpoint']} "
                          f"({best['value']:.3f})")
    summary = train_summary(global_step, train_start, logger)
    if best:  # HF's names
        summary.update(best_model_checkpoint=best["checkpoint"], best_metric=best["value"], best_step=best["step"])
    evaluate_after(accelerator, evaluate if eval_set is not None else None, summary, heldout_before,
                  summarize=heldout_summary, describe=heldout_lines)
    finish_run(accelerator, cfg, logger, uploader, summary,
               curves=[("reward_curve.png", ["reward"] + [f"rewards/{n}" for n in cfg.reward_funcs], 0.8)])
    return policy


def better_checkpoint(best, result, cfg, step, print_fn=print):
    """The best checkpoint so far once `step`'s is scored on the validation rows (`result`, higher
    --metric_for_best_model is better; a tie keeps the earlier one): {"step", "checkpoint", "metric", "value"}."""
    metric = cfg.metric_for_best_model or "accuracy"
    value = result[metric]
    if best is None or value > best["value"]:
        best = {"step": step, "checkpoint": os.path.join(cfg.output_dir, f"{CHECKPOINT_PREFIX}{step}"),
                "metric": metric, "value": value}
    print_fn(f"step {step}: validation {metric} {value:.3f} ({result['samples']} rows; best: step {best['step']}, "
             f"{best['value']:.3f})")
    return best


def heldout_summary(after, before):
    """The run summary's held-out entries: heldout_<key>_after, and heldout_<key>_before."""
    return {**{f"heldout_{k}_after": v for k, v in after.items()},
            **{f"heldout_{k}_before": v for k, v in (before or {}).items()}}


def heldout_lines(after, before):
    """What the run prints of its held-out accuracy."""
    if before:
        return [f"held-out accuracy: before {before['accuracy']:.3f} -> after {after['accuracy']:.3f} "
                f"({after['samples']} questions)"]
    return [f"held-out accuracy after GRPO: {after['accuracy']:.3f} ({after['samples']} questions)"]


# ---- the phases of a round, in the loop's order ----


def sample_round(ro, sampler, *, step, round_index, trainer_state, reward_log, timings):
    """Phases 1-2: the round's S micro-batches (--steps_per_generation), sampled and scored. Under --dynamic_sampling
    (DAPO) only groups whose rewards vary are kept, the round refilled with groups of new prompts first. Returns (the
    micro-batches, the dynamic-sampling metrics)."""
    cfg, L = ro.cfg, ro.layout

    def draw(num_prompts, micro):  # the next prompts of the sampler's stream, as micro-batch `micro`
        mb = sample_micro_batch(ro, sampler.take(num_prompts, step), micro, round_index=round_index, step=step,
                                timings=timings)
        score_micro_batch(ro, mb, trainer_state=trainer_state, reward_log=reward_log, timings=timings)
        return mb

    ro.policy.eval()
    generated = [draw(L.prompts_per_micro, micro) for micro in range(L.S)]
    if not cfg.dynamic_sampling:
        return generated, {}
    groups, extra_rounds = dynamic_sampling(generated, draw, L.S * L.prompts_per_micro, L.prompts_per_micro, L.G,
                                            L.world, ro.reward_weights, cfg.use_pcgrad, cfg.max_resample_rounds)
    with timed(timings, "generation"):
        chosen = choose_groups(groups, L.S * L.prompts_per_micro)
        batches = [rebuild_micro_batch(ro, chosen[m * L.prompts_per_micro:(m + 1) * L.prompts_per_micro])
                   for m in range(L.S)]
    return batches, {"frac_zero_std_groups": 1.0 - sum(g["spread"] for g in groups) / len(groups),
                     "resample_rounds": extra_rounds, "generated_groups": len(groups)}


def sample_micro_batch(ro, prompt_idx, micro, *, round_index, step, timings):
    """Phase 1: micro-batch `micro` of round `round_index`: G completions of each prompt in `prompt_idx`, spread over
    the processes; this process samples its share. A refill under --dynamic_sampling may hold fewer prompts than a
    full micro-batch (still a whole number of completions per process)."""
    L = ro.layout
    global_rows = [i for i in prompt_idx for _ in range(L.G)]
    b = len(global_rows) // L.world  # completions per process: B, or fewer in a refill
    mine = global_rows[L.rank * b:(L.rank + 1) * b]
    rows = [ro.dataset[i] for i in mine]
    seeds = completion_seeds(ro.cfg.seed, round_index,
                             range(micro * L.B * L.world + L.rank * b, micro * L.B * L.world + (L.rank + 1) * b))
    with timed(timings, "generation"):
        return rollout(ro, rows, keys=mine, sample_ids=[str(r.get("id", i)) for r, i in zip(rows, mine)],
                       seeds=seeds, step=step, prompt_rows=list(prompt_idx))


def score_micro_batch(ro, mb, *, trainer_state, reward_log, timings):
    """Phase 2: this process's completions scored by the reward functions (called as TRL calls them), the rewards
    of all processes gathered so that every process sees whole groups. The rewards' logged columns go to
    `reward_log` (and the micro-batch's share of them to mb.extra)."""
    with timed(timings, "rewards"):
        columns = reward_inputs(ro, mb)
        before = {column: len(values) for column, values in reward_log.extra.items()}
        local_rewards = call_rewards(ro.reward_fns, ro.cfg.reward_funcs, prompts=mb.messages,
                                     completions=mb.completions, completion_ids=mb.token_ids,
                                     columns=columns, trainer_state=trainer_state, log=reward_log)
        mb.extra = {k: v[before.get(k, 0):] for k, v in reward_log.extra.items()}
        mb.rewards = ro.accelerator.gather(local_rewards.to(ro.accelerator.device)).cpu()
        if ro.cfg.dynamic_sampling:  # groups may be regrouped across processes: every process needs every completion
            mb.all_token_ids = [t for part in gather_object([mb.token_ids]) for t in part]
            if mb.sampler_logps is not None:
                mine = [lp[m.bool()].tolist() for lp, m in zip(mb.sampler_logps, mb.completion_mask)]
                mb.all_sampler_logps = [lp for part in gather_object([mine]) for lp in part]


def add_advantages(ro, *micro_batches):
    """Phase 3, for each micro-batch: the group-normalised advantages of the gathered rewards (one per reward function
    under PCGrad) and this process's rows of them; which completions were cut at the length limit, and the loss
    mask."""
    cfg, L = ro.cfg, ro.layout
    for mb in micro_batches:
        if cfg.use_pcgrad:  # one advantage per reward function, each normalised within its groups
            mb.all_advantages = torch.stack([group_advantages(mb.rewards[:, j], L.G, scale=cfg.scale_rewards)
                                             for j in range(len(ro.reward_fns))], dim=-1)
        else:
            mb.all_advantages = group_advantages(mb.rewards, L.G, weights=ro.reward_weights, scale=cfg.scale_rewards)
        mb.advantages = mb.all_advantages[L.local].to(ro.accelerator.device)
        # a tool trajectory also ends truncated when a tool's results do not fit (utils/core/tool_rollout.py)
        mb.truncated = (mb.tool_truncated if mb.tool_truncated is not None
                        else truncated_completions(mb.completion_ids, mb.completion_mask, ro.stop_ids))
        # the loss and the KL see the model's own tokens only; a trajectory's tool tokens stay in the context
        mb.loss_mask = (mb.sampled_mask * ~mb.truncated[:, None] if cfg.mask_truncated_completions
                        else mb.sampled_mask)


@torch.no_grad()
def add_fixed_logprobs(policy, ref_policy, cfg, batches, *, behaviour):
    """Phase 4: the log-probs that stay fixed while the round trains: the behaviour policy's (only when the round
    feeds more than one optimizer step, --num_iterations > 1 or --steps_per_generation above the step's micro-batches:
    the policy moves before the later steps, and the importance ratio against these handles it; with one step they
    equal the policy's own, detached) and the reference's (--beta)."""
    for mb in batches:
        args = (mb.prompt_batch, mb.completion_ids, mb.completion_mask, cfg.temperature)
        mb.old_logps = policy(*args, **mb.policy_inputs()) if behaviour else None
        mb.ref_logps = ref_policy(*args, **mb.policy_inputs()) if ref_policy else None


def optimisation_pass(ro, batches, *, optimizer, pcgrad, step_tokens, loss_divisor, step, timings, guard):
    """Phase 5: one optimizer step over the round's micro-batches (gradients accumulated over them): the clipped
    surrogate (utils.core.losses.clipped_policy_loss; one per reward function under PCGrad), backward, clipping at
    --max_grad_norm, the AdamW step unless `guard` skips it (a non-finite loss or gradient norm on any process).
    Returns the step's loss and statistics for the log."""
    cfg, accelerator, policy, GA = ro.cfg, ro.accelerator, ro.policy, ro.layout.GA
    step_loss, step_stats, grad_norm, vllm_stats, stepped = 0.0, [], None, [], True
    clear_stale_zero3_gradients(accelerator, policy)  # one optimizer step per pass (utils/core/zero3.py)
    for mb in batches:
        t0 = time.perf_counter()
        with accelerator.accumulate(policy):
            # PCGrad takes its own gradients, so its forward skips the DDP wrapper
            forward = accelerator.unwrap_model(policy) if pcgrad else policy
            # the entropy comes from the same fused head pass (no extra vocabulary pass)
            logps, entropy = forward(mb.prompt_batch, mb.completion_ids, mb.completion_mask, cfg.temperature,
                                     return_entropy=True, **mb.policy_inputs())
            old = mb.old_logps if mb.old_logps is not None else logps.detach()
            if mb.policy_logps is None:
                mb.policy_logps = logps.detach()
            # vLLM sampled with its own kernels: truncated importance weights pi_old / pi_vllm per token
            is_weights = None
            if mb.sampler_logps is not None:
                if cfg.vllm_importance_sampling_correction:
                    is_weights = importance_weights(old, mb.sampler_logps, mb.sampled_mask,
                                                    mode=cfg.vllm_importance_sampling_mode,
                                                    cap=cfg.vllm_importance_sampling_cap)
                vllm_stats.append(mismatch_stats(old, mb.sampler_logps, mb.sampled_mask, is_weights))
            loss_kw = dict(epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high, ref_logps=mb.ref_logps,
                           loss_type=cfg.loss_type, importance_sampling_level=cfg.importance_sampling_level,
                           max_completion_length=cfg.max_completion_length, num_items_in_batch=step_tokens,
                           num_processes=ro.layout.world, is_weights=is_weights, entropy=entropy,
                           entropy_coef=cfg.entropy_coef, entropy_threshold=cfg.entropy_threshold,
                           gradient_accumulation_steps=GA, kl_bias_correction=cfg.use_bias_correction_kl)
            if cfg.top_entropy_quantile < 1.0:  # quantile over the micro-batch of every process (TRL)
                loss_kw["entropy_mask"] = high_entropy_mask(entropy, mb.loss_mask, cfg.top_entropy_quantile,
                                                            gather=gather_padded(accelerator))
            if pcgrad:
                loss, stats = pcgrad_losses(pcgrad, logps, old, mb, ro.reward_weights, cfg, 1.0 / loss_divisor,
                                            **loss_kw)
                if accelerator.sync_gradients:
                    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
                    pcgrad.write_gradients(reduce=(lambda t: accelerator.reduce(t, "mean")) if ro.layout.world > 1
                                           else None, generator=generator)
            else:
                loss, stats = clipped_policy_loss(logps, old, mb.advantages, mb.loss_mask, beta=cfg.beta, **loss_kw)
                # accelerate divides by GA: what reaches the gradients is the micro-batch's step share
                accelerator.backward(loss * (GA / loss_divisor))
            if accelerator.sync_gradients and cfg.max_grad_norm:
                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            if accelerator.sync_gradients:
                stepped = guard.step_ok(step + 1, step_loss + loss.detach() / loss_divisor, grad_norm,
                                        policy.parameters(), optimizer)
            if stepped:
                optimizer.step()
            optimizer.zero_grad()
        timings["backward"] += time.perf_counter() - t0
        step_loss += loss.detach() / loss_divisor
        step_stats.append(stats)
    return PassResult(loss=step_loss, stats=step_stats, grad_norm=grad_norm, vllm_stats=vllm_stats, stepped=stepped)


def log_step(ro, logger, step, batches, result, *, sampling, reward_log, learning_rate, step_time, timings,
             skipped_steps=0):
    """Phase 6: the step's metrics row (docs/grpo.md lists them) and, with --log_completions, its completions."""
    metrics = step_metrics(ro, batches, result)
    metrics.update(sampling, **reward_log.metric_means(), skipped_steps=skipped_steps)
    if result.vllm_stats:  # sums and maxima over the step's micro-batches, then over the processes
        combined = {k: (torch.stack([st[k] for st in result.vllm_stats]).max() if k.endswith("max")
                        else sum(st[k] for st in result.vllm_stats)) for k in result.vllm_stats[0]}
        metrics.update(mismatch_metrics(combined, ro.accelerator.reduce))
    metrics.update(learning_rate=learning_rate, step_time=step_time, **{f"time/{k}": v for k, v in timings.items()})
    logger.log(step, metrics)
    if ro.cfg.log_completions:
        log_step_completions(ro, logger, step, batches)


# ---- what the phases call ----


def step_metrics(ro, batches, result):
    """What one optimizer step logs: rewards as TRL logs them (weighted, unscorable completions left out; per
    function), loss, KL, clipping, the largest importance-ratio deviation, the gradient norm before clipping and
    the completion length."""
    accelerator, step_stats = ro.accelerator, result.stats
    rewards = torch.cat([mb.rewards for mb in batches])
    weighted = weighted_rewards(rewards, ro.reward_weights)
    scored = weighted[~weighted.isnan()]

    def mean_over_steps(key):
        return accelerator.reduce(sum(s[key] for s in step_stats) / len(step_stats), "mean").item()

    lengths = torch.cat([accelerator.gather(mb.sampled_mask.sum(-1)).float().cpu() for mb in batches])
    cut = torch.cat([accelerator.gather(mb.truncated).float().cpu() for mb in batches])
    metrics = {
        "loss": accelerator.reduce(result.loss, "mean").item(),
        "reward": scored.mean().item() if len(scored) else float("nan"),
        "reward_std": scored.std().item() if len(scored) > 1 else float("nan"),
        "frac_reward_zero_std": 1.0 - has_spread(rewards, ro.reward_weights, ro.layout.G).float().mean().item(),
        "frac_unscorable": weighted.isnan().float().mean().item(),
        "kl": mean_over_steps("kl"),
        "entropy": mean_over_steps("entropy"),
        "entropy_high_frac": mean_over_steps("entropy_high_frac"),
        "clip_ratio": mean_over_steps("clip_ratio"),
        "grad_norm": float(result.grad_norm) if result.grad_norm is not None else float("nan"),
        "ratio_max_dev": accelerator.reduce(torch.stack([s["ratio_max_dev"] for s in step_stats]).max(), "max").item(),
        "completion_length": lengths.mean().item(),
        "completions/clipped_ratio": cut.mean().item(),
    }
    for j, name in enumerate(ro.cfg.reward_funcs):
        values = rewards[:, j][~rewards[:, j].isnan()]
        metrics[f"rewards/{name}"] = values.mean().item() if len(values) else float("nan")
    if ro.tools is not None:  # tools/call_frequency and tools/failure_frequency are TRL's names
        metrics.update(tool_metrics([mb.tool_stats for mb in batches], gather_object))
    return metrics


def gather_padded(accelerator):
    """1-D tensors of every process concatenated, each padded with -1 to the longest (None on one process)."""
    if accelerator.num_processes == 1:
        return None
    return lambda t: accelerator.gather(accelerator.pad_across_processes(t, dim=0, pad_index=-1))


def log_step_completions(ro, logger, step, batches):
    """Every completion of the step (all processes) to completions.jsonl, as TRL's completions table; a few to
    the console (--num_completions_to_print)."""
    cfg, accelerator, rows = ro.cfg, ro.accelerator, []
    for mb_index, mb in enumerate(batches):
        n = len(mb.ids)
        mine = slice(accelerator.process_index * n, (accelerator.process_index + 1) * n)
        rewards = mb.rewards[mine]
        weighted = weighted_rewards(rewards, ro.reward_weights).tolist()
        for k, (sid, r, text) in enumerate(zip(mb.ids, mb.rows, mb.texts)):
            row = dict(id=sid, prompt=prompt_question(r, prompt_column=cfg.prompt_column), completion=text,
                       reward=None if math.isnan(weighted[k]) else weighted[k],
                       advantage=mb.all_advantages[mine][k].tolist(),
                       rewards={name: None if math.isnan(v) else v
                                for name, v in zip(cfg.reward_funcs, rewards[k].tolist())})
            if mb.model_mask is not None:  # the turns (tool images saved beside completions.jsonl) and the tokens
                n = int(mb.completion_mask[k].sum())
                row.update({key: values[k] for key, values in mb.tool_stats.items()},
                           turns=log_turns(mb.completions[k], cfg.output_dir, step,
                                           f"{sid}-{mb_index}-{accelerator.process_index}-{k}"),
                           token_ids=mb.completion_ids[k, :n].tolist(), model_mask=mb.model_mask[k, :n].tolist(),
                           logps=mb.policy_logps[k, :n].tolist(),
                           truncated=bool(mb.truncated[k]))
            row.update({column: values[k] for column, values in mb.extra.items() if k < len(values)})
            rows.append(row)
    if accelerator.num_processes > 1:
        rows = gather_object(rows)
    logger.log_completions(step, rows)
    for row in rows[:cfg.num_completions_to_print]:
        accelerator.print(f"[step {step}] {row['id']} reward {row['reward']}: {row['completion'][:200]!r}")


def encode_rows(ro, rows, *, keys, sample_ids):
    """Chat messages and the encoded prompt batch of `rows` (rows with equal `keys` are the same prompt).

    When the model allows it, each distinct prompt is encoded once and its completions share its forward pass
    in training: `prompt_batch` then has one row per prompt and `prompt_index` maps completions to prompts
    (None otherwise)."""
    cfg, accelerator = ro.cfg, ro.accelerator
    # TRL's prompt column, or the question/image columns through --prompt_template (utils/core/conversations.py)
    messages = [prompt_messages(r, prompt_column=cfg.prompt_column, prompt_template=cfg.prompt_template,
                                system_prompt=cfg.system_prompt) for r in rows]
    images = [prompt_images(r, cfg.prompt_column) for r in rows]
    unique = sorted(set(keys), key=keys.index)
    first = [keys.index(k) for k in unique]
    clips = row_clips(ro.processor, rows, cfg)
    if can_share_prompts(accelerator.unwrap_model(ro.policy).model, [len(images[j]) for j in first],
                         [len(clips[j]) for j in first]):
        prompt_index = torch.tensor([unique.index(k) for k in keys], device=accelerator.device)
    else:
        prompt_index, first = None, list(range(len(rows)))
    prompt_batch = encode_prompts(ro.processor, [messages[j] for j in first], [images[j] for j in first],
                                  sample_ids=[sample_ids[j] for j in first], max_prompt_length=cfg.max_prompt_length,
                                  videos=[clips[j] for j in first],
                                  tools=ro.tools.toolbox.schemas if ro.tools else None).to(accelerator.device)
    return messages, prompt_batch, prompt_index


def rollout(ro, rows, *, keys, sample_ids, seeds, step=0, prompt_rows=()):
    """Sample one completion per row (rows with equal `keys` are the same prompt; see `encode_rows`). Where the
    prompts are shared, each is prefilled once in generation too, and its completions continue from its cache.
    With vLLM (ro.vllm) its log-prob of each sampled token comes back too (`sampler_logps`)."""
    cfg, accelerator, processor = ro.cfg, ro.accelerator, ro.processor
    tokenizer = getattr(processor, "tokenizer", processor)
    messages, prompt_batch, prompt_index = encode_rows(ro, rows, keys=keys, sample_ids=sample_ids)
    sampler_logps = None
    if ro.vllm is not None:  # the same prompt ids (shared rows too); vLLM's log-probs of the sampled tokens come back
        completion_ids, completion_mask, sampler_logps = ro.vllm.generate(
            ro.policy, processor, messages, [prompt_images(r, cfg.prompt_column) for r in rows], seeds, step=step,
            stop_ids=ro.stop_ids,
            suppress_ids=ro.suppress_ids, prompt_batch=prompt_batch, prompt_index=prompt_index, return_logprobs=True,
            videos=row_clips(processor, rows, cfg))
    else:
        generate = ro.compiled.generate if ro.compiled is not None else generate_completions  # --cache_implementation
        with unwrap_for_generation(ro.policy, accelerator) as unwrapped:  # a group's prompt is prefilled once
            completion_ids, completion_mask = generate(
                unwrapped.model, prompt_batch, row_seeds=seeds, max_new_tokens=cfg.max_completion_length,
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=ro.stop_ids,
                pad_token_id=tokenizer.pad_token_id, suppress_token_ids=ro.suppress_ids, prompt_index=prompt_index)
    tool_fields = {}
    if ro.tools is not None:  # go on past the first turn: tool calls, tool results, the model's next turns
        trajectories = tool_trajectories(ro, rows, keys, sample_ids, seeds, step,
                                         (completion_ids, completion_mask, sampler_logps))
        completion_ids, completion_mask = trajectories.completion_ids, trajectories.completion_mask
        sampler_logps = trajectories.sampler_logps
        tool_fields = dict(model_mask=trajectories.model_mask, completion_inputs=trajectories.completion_inputs,
                           tool_images=trajectories.tool_images, tool_truncated=trajectories.truncated,
                           tool_stats={k: getattr(trajectories, k) for k in ("tool_calls", "tool_errors",
                                                                             "tool_timeouts", "turns", "tool_tokens")})
    texts = tokenizer.batch_decode(completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    token_ids = [c[m.bool()].tolist() for c, m in zip(completion_ids, completion_mask)]
    completions = trajectories.completions if ro.tools is not None else trl_completions(messages, texts)
    return MicroBatch(prompt_rows=list(prompt_rows), rows=rows, indices=list(keys), ids=list(sample_ids),
                      messages=messages, prompt_batch=prompt_batch, prompt_index=prompt_index,
                      completion_ids=completion_ids, completion_mask=completion_mask, texts=texts, token_ids=token_ids,
                      completions=completions, sampler_logps=sampler_logps, **tool_fields)


def tool_trajectories(ro, rows, keys, sample_ids, seeds, step, first):
    """--tools: the trajectories that go on from the first turns `first` (utils/core/tool_rollout.py), each later
    turn sampled by the same engine (HF generate or vLLM) from the conversation so far."""
    cfg, accelerator = ro.cfg, ro.accelerator
    tokenizer = getattr(ro.processor, "tokenizer", ro.processor)
    messages = [prompt_messages(r, prompt_column=cfg.prompt_column, prompt_template=cfg.prompt_template,
                                system_prompt=cfg.system_prompt) for r in rows]
    images = [prompt_images(r, cfg.prompt_column) for r in rows]

    # one gather of the weights for the whole loop (under ZeRO-3): processes run different numbers of turns, so no
    # turn may wait on another process
    engine = contextlib.nullcontext(None) if ro.vllm is not None else unwrap_for_generation(ro.policy, accelerator)
    with engine as unwrapped:

        def generate(batch, segment_seeds, max_new_tokens, context_images):
            if unwrapped is None:  # vLLM: the context's ids and its images, as the first turn's prompt
                return ro.vllm.generate(ro.policy, ro.processor, None, context_images, segment_seeds, step=step,
                                        stop_ids=ro.stop_ids, suppress_ids=ro.suppress_ids, prompt_batch=batch,
                                        return_logprobs=True)
            ids, mask = generate_completions(
                unwrapped.model, batch, row_seeds=segment_seeds, max_new_tokens=max_new_tokens,
                temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=ro.stop_ids,
                pad_token_id=tokenizer.pad_token_id, suppress_token_ids=ro.suppress_ids)
            return ids, mask, None

        return ro.tools.run(messages, images, sample_ids, seeds, first, generate,
                            pad_token_id=tokenizer.pad_token_id, device=accelerator.device,
                            tools=ro.tools.toolbox.schemas, keys=list(keys))


def rebuild_micro_batch(ro, groups):
    """A micro-batch of kept groups (from any micro-batch, any process; `utils.core.groups.split_groups`): this
    process re-encodes its prompts and takes its completions' token ids, rewards (and vLLM's log-probs) from the
    gathered ones."""
    L, accelerator = ro.layout, ro.accelerator
    tokenizer = getattr(ro.processor, "tokenizer", ro.processor)
    global_rows = [g["prompt"] for g in groups for _ in range(L.G)]
    token_ids = [t for g in groups for t in g["token_ids"]][L.local]
    keys = global_rows[L.local]
    rows = [ro.dataset[i] for i in keys]
    ids = [str(r.get("id", i)) for r, i in zip(rows, keys)]
    messages, prompt_batch, prompt_index = encode_rows(ro, rows, keys=keys, sample_ids=ids)
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
        for k, lp in enumerate([lp for g in groups for lp in g["sampler_logps"]][L.local]):
            sampler_logps[k, :len(lp)] = torch.tensor(lp)
        sampler_logps = sampler_logps.to(accelerator.device)
    return MicroBatch(prompt_rows=[g["prompt"] for g in groups], rows=rows, indices=keys, ids=ids, messages=messages,
                      prompt_batch=prompt_batch, prompt_index=prompt_index,
                      completion_ids=completion_ids.to(accelerator.device),
                      completion_mask=completion_mask.to(accelerator.device), texts=texts, token_ids=token_ids,
                      completions=trl_completions(messages, texts), sampler_logps=sampler_logps,
                      rewards=torch.cat([g["rewards"] for g in groups]))


# Checkpoint subfolders of train_grpo's own state: the rest of a round (`round_state`), the synced reference.
ROUND_FILE, REFERENCE_FILE = "round", "reference_sync"


def round_state(ro, batches, position, reward_log, sampling):
    """What a checkpoint taken inside a round keeps so that the round's remaining optimizer steps run as they would
    have: every process's completions of each micro-batch (token ids, vLLM's log-probs), the rewards, the behaviour
    and reference log-probs (computed before the policy moved; gathered, padded), the reward functions' logged
    metrics and columns, the dynamic-sampling metrics and the next step's `position` in the round. Returns (the JSON
    part for trainer_state.json, the tensors for the checkpoint). Every process calls it (gathers)."""
    accelerator, meta, tensors = ro.accelerator, [], {}
    for k, mb in enumerate(batches):
        token_ids = mb.all_token_ids or [t for part in gather_object([mb.token_ids]) for t in part]
        sampler = mb.all_sampler_logps
        if sampler is None and mb.sampler_logps is not None:
            mine = [lp[m.bool()].tolist() for lp, m in zip(mb.sampler_logps, mb.completion_mask)]
            sampler = [lp for part in gather_object([mine]) for lp in part]
        meta.append(dict(prompt_rows=list(mb.prompt_rows), token_ids=token_ids, sampler_logps=sampler,
                         extra=mb.extra))
        tensors[f"{k}.rewards"] = mb.rewards.contiguous()
        for name in ("old_logps", "ref_logps"):
            value = getattr(mb, name)
            if value is not None:
                tensors[f"{k}.{name}"] = accelerator.gather(accelerator.pad_across_processes(value, dim=1)).cpu()
    return dict(position=position, micro_batches=meta, reward_metrics=reward_log.metrics, sampling=sampling), tensors


def restore_round(ro, path, saved):
    """The round a checkpoint was taken in (`round_state`): its micro-batches rebuilt on this process from the saved
    completions (`rebuild_micro_batch`), the advantages recomputed from the saved rewards, the saved log-probs."""
    tensors, L, device = read_tensors(path, ROUND_FILE), ro.layout, ro.accelerator.device
    batches = []
    for k, entry in enumerate(saved["micro_batches"]):
        rewards, ids = tensors[f"{k}.rewards"], entry["token_ids"]
        groups = [dict(prompt=p, token_ids=ids[g * L.G:(g + 1) * L.G], rewards=rewards[g * L.G:(g + 1) * L.G],
                       sampler_logps=None if entry["sampler_logps"] is None
                       else entry["sampler_logps"][g * L.G:(g + 1) * L.G])
                  for g, p in enumerate(entry["prompt_rows"])]
        mb = rebuild_micro_batch(ro, groups)
        mb.extra = entry["extra"]
        add_advantages(ro, mb)
        width = mb.completion_ids.shape[1]
        for name in ("old_logps", "ref_logps"):
            if f"{k}.{name}" in tensors:
                setattr(mb, name, tensors[f"{k}.{name}"][L.local][:, :width].to(device))
        batches.append(mb)
    return dict(batches=batches, position=saved["position"], reward_metrics=saved["reward_metrics"],
                sampling=saved["sampling"])


def round_saves(ro, state, batches, next_position, reward_log, sampling, ref_sync):
    """A checkpoint's tensor files ({folder: writer}, for save_and_push's extra_saves): inside a round (it goes on
    at `next_position`) the rest of the round (`round_state`, described in `state["round"]`), and with
    --sync_ref_model the reference's weights. Every process joins the gathers; the main process writes."""
    saves = {}
    if next_position is not None:
        state["round"], saves[ROUND_FILE] = round_state(ro, batches, next_position, reward_log, sampling)
    if ref_sync is not None:
        saves[REFERENCE_FILE] = ref_sync.state_tensors()
    return {name: tensor_saver(name, t) for name, t in saves.items()}


def tensor_saver(name, tensors):
    """A checkpoint's `extra_saves` entry writing `tensors` to <name>/tensors.safetensors (the main process's)."""
    def save(folder):
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "tensors.safetensors"))
    return save


def read_tensors(path, name):
    """The tensors `tensor_saver` wrote in checkpoint `path` ({} when it wrote none)."""
    file = os.path.join(path, name, "tensors.safetensors")
    return load_file(file) if os.path.exists(file) else {}


def trl_completions(prompts, texts):
    """Completions as TRL passes them to rewards: strings after plain-text prompts, else assistant messages."""
    return list(texts) if all(isinstance(p, str) for p in prompts) else as_conversation(texts)


def reward_inputs(ro, mb):
    """The keywords a reward gets besides TRL's own: every data set column but the prompt (one entry per completion),
    and with --tools each trajectory's count of tool calls."""
    columns = {c: [r[c] for r in mb.rows] for c in reward_columns(ro.dataset.column_names, ro.cfg.prompt_column)}
    if mb.tool_stats is not None:
        columns["tool_calls"] = list(mb.tool_stats["tool_calls"])
    return columns


def pcgrad_losses(pcgrad, logps, old, mb, reward_weights, cfg, scale, **loss_kw):
    """One clipped surrogate per reward function (each with its own advantage), added to the step's PCGrad
    accumulator with the KL term as an unprojected extra. Returns (total loss, stats) like `clipped_policy_loss`;
    the stats are those of the weighted advantage sum."""
    weights = reward_weights.tolist()
    losses = [w * clipped_policy_loss(logps, old, mb.advantages[:, j], mb.loss_mask, beta=0.0, **loss_kw)[0]
              for j, w in enumerate(weights)]
    kl_loss = clipped_policy_loss(logps, logps.detach(), torch.zeros_like(mb.advantages[:, 0]), mb.loss_mask,
                                  beta=cfg.beta, **loss_kw)[0]
    pcgrad.add([loss * scale for loss in losses], extra_loss=kl_loss * scale if cfg.beta else None)
    with torch.no_grad():
        _, stats = clipped_policy_loss(logps.detach(), old, mb.advantages @ reward_weights.to(logps.device),
                                       mb.loss_mask, beta=cfg.beta, **loss_kw)
    return sum(losses) + kl_loss, stats


def difficulty_levels(ro):
    """easy/medium/hard per training question: the data set's column, or estimated with the current model.

    The estimate is the error rate over --difficulty_samples sampled answers (the training rollout, on the HF path),
    scored by --difficulty_reward (a reward >= 1 counts as correct), optionally averaged with --rating_column;
    questions are shared out over the processes and the scores gathered, so every process builds the same stages.
    """
    cfg, dataset, accelerator = ro.cfg, ro.dataset, ro.accelerator
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
    judge = ro.reward_fns[cfg.reward_funcs.index(name)]
    rank, world, k = accelerator.process_index, accelerator.num_processes, cfg.difficulty_samples
    hf = replace(ro, vllm=None, compiled=None)  # the eager HF rollout
    mine = list(range(rank, len(dataset), world))
    errors = {}
    ro.policy.eval()
    chunk = max(1, cfg.per_device_train_batch_size // k)
    for start in range(0, len(mine), chunk):
        idx = mine[start:start + chunk]
        keys = [i for i in idx for _ in range(k)]
        rows = [dataset[i] for i in keys]
        out = rollout(hf, rows, keys=keys, sample_ids=[r["id"] for r in rows],
                      seeds=completion_seeds(cfg.seed, -1, [i * k + j for i in idx for j in range(k)]))
        scores = call_rewards([judge], [name], prompts=out.messages, completions=out.completions,
                              completion_ids=out.token_ids, columns=reward_inputs(ro, out),
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
    watch_stage_parent()  # a stage of iterate.py ends with it, however it ends
    with exit_on_bad_input("train_grpo.py"):  # bad input (data, prompts, model paths) ends in one line
        main(parse_args())
