"""R3 Mix-GRPO: GRPO on a VLM's text reasoning and on a flow-matching generator's SDE steps, in one script.

    accelerate launch train_mixgrpo.py                                   # tiny CPU recipe
    accelerate launch --config_file accelerate_configs/zero3.yaml train_mixgrpo.py --config recipes/r3_geneval.yaml

Reason stage (even steps): prompt -> `<think>..</think>` (the VLM) -> image (Qwen-Image, conditioned on the prompt
and the reasoning). Reflect + refine (odd steps): a buffered image -> reflection + edit instruction -> the image
refined (by Qwen-Image-Edit with --edit_generator_name_or_path). Each prompt gets `group_size` rollouts spread over
`policy_group_size` processes; the group shares the initial noise and the SDE step index, the rest of the
trajectory is ODE. The text part (token clipped surrogate + k3 KL) and the image part (clipped surrogate on the SDE
steps' log-probs + the image KL) get their own advantages and weights. The VLM and the generators are one module
(`MixGRPOModel`), so DDP or one DeepSpeed engine wraps them. docs/mixgrpo.md has the formulas and the tests.
"""

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional

import torch
from accelerate.utils import gather_object

from kernels import group_advantages
from tiny.cache import resolve_tiny_t2i, tiny_recipe
from utils.core.checkpoint import save_and_push
from utils.core.config import ConfigError, choice, parse_config
from utils.core.encoding import encode_prompts
from utils.core.errors import InputError, exit_on_bad_input
from utils.core.flags import CheckpointFlags
from utils.core.guards import StepGuard, UnscoredStreak
from utils.core.launch import relaunch_multi_cpu_if_needed, watch_stage_parent
from utils.core.logprobs import prepare_reference_model
from utils.core.losses import clipped_policy_loss
from utils.core.models import has_adapters
from utils.core.optim import OptimizerFlags, check_optimizer_flags, num_warmup_steps
from utils.core.records import Record
from utils.core.reward_calls import build_image_reward, score_images
from utils.core.rollout import generate_completions, special_token_ids_to_suppress, stop_token_ids
from utils.core.run import finish_run, is_due, make_accelerator, prepare_training, resume_run, seed_run, start_logging
from utils.core.samplers import SeededSampler
from utils.core.seeds import completion_seeds
from utils.core.tracking import train_summary
from utils.core.zero3 import clear_stale_zero3_gradients, is_zero3, unwrap_for_generation
from utils.eval.heldout import evaluate_after, evaluate_before
from utils.t2i.data import load_prompts
from utils.t2i.generators import Guidance, SDEStep, sample  # noqa: F401  (Guidance: as tm.Guidance in scripts, tests)
from utils.t2i.guidance import RENORM_TYPES
from utils.t2i.mixgrpo_eval import evaluate_reason, heldout_lines, heldout_summary
from utils.t2i.mixgrpo_model import (
    MixGRPOModel,
    build_edit_generator,
    build_policy,
    check_generators,
    check_policy,
    check_renorm_flags,
    edit_guidance,
    image_condition,
    load_generator,
    own_processor,
    reason_guidance,
)
from utils.t2i.r3_format import (
    REASON_PROMPT,
    REFLECT_PROMPT,
    reason_rewards,
    reasoning_of,
    reflect_rewards,
    reflection_of,
    user_message,
)
from utils.t2i.scoring import RewardScorer
from utils.t2i.sde import image_kl

REPO = os.path.dirname(os.path.abspath(__file__))
TINY = "tiny"
TINY_MIXGRPO_RECIPE = os.path.join(REPO, "recipes", "tiny_mixgrpo.yaml")
DATASETS = ("shapes_t2i", "geneval", "geneval_plus", "tiif", "prompts")
REWARDS = ("shapes_t2i", "geneval", "judge_geneval_plus", "judge_tiif", "pickscore", "clipscore", "aesthetic", "hpsv2",
           "imagereward", "ocr", "unifiedreward", "weighted")
JUDGES = ("judge_geneval_plus", "judge_tiif", "unifiedreward")  # rewards that send an API key to a chat endpoint


@dataclass
class MixGRPOConfig(CheckpointFlags, OptimizerFlags):
    """R3's Mix-GRPO: GRPO on a VLM's text reasoning and on a flow-matching generator's SDE steps, in one run. Even
    steps reason (prompt -> reasoning -> image), odd steps reflect on a buffered image and refine it; the text part
    and the image part get their own advantages, losses and KL weights. Flags override the recipe of --config;
    without one, the tiny CPU recipe (recipes/tiny_mixgrpo.yaml) runs under the flags given, unless they name models
    of their own. docs/mixgrpo.md has the formulas, docs/flags.md every flag."""

    RECIPE_FOLLOWERS: ClassVar[dict] = {"reward_fn": ("reward_kwargs",)}  # the tiny recipe's options fit its reward

    # model
    model_name_or_path: str = field(default=TINY, metadata={
        "help": "the policy VLM (Qwen2.5-VL); 'tiny': tiny-planner, which writes the plans the tiny generator draws "
                "(tiny-reflector, which also reflects, when --reflect_refine is on)"})
    generator_name_or_path: str = field(default=TINY, metadata={
        "help": "a pipeline folder or hub name: Qwen-Image (+ Edit, Edit Plus), Qwen-Image 2.1, SD3/3.5, FLUX.1, "
                "FLUX.2 Klein; 'tiny': the pre-trained tiny Qwen-Image (tiny/generator.py)"})
    edit_generator_name_or_path: Optional[str] = field(default=None, metadata={
        "help": "the refine stage's generator (a Qwen-Image-Edit or Edit Plus folder or hub name, beside a Qwen-Image "
                "generator), with its own LoRA; none: the reason stage's generator refines too; 'tiny': the tiny "
                "generator taught to edit (tiny/edit_generator.py)"})
    generator_kwargs: dict = field(default_factory=dict, metadata={
        "help": "JSON options of the generator's adapter (utils/t2i/adapters.py), e.g. FLUX.2 Klein's "
                "{\"text_encoder_out_layers\": [9, 18, 27]}"})
    dtype: str = choice("float32", "bfloat16", help="weights dtype of both parts")
    conditioning: str = choice("base", "policy", "generator",
                               help="the image model reads the VLM's base weights (no grad), the policy as it trains, "
                                    "or its pipeline's own frozen text encoder (a VLM other than the policy)")
    attn_implementation: Optional[str] = None  # VLM attention: sdpa, eager, flash_attention_2; none: the default
    freeze_vision_tower: bool = False  # freeze the VLM's vision encoder, its LoRA too
    gradient_checkpointing: bool = False  # recompute activations of both parts in backward
    use_peft: bool = False  # LoRA on the VLM (its reference is then the VLM with adapters off)
    lora_r: int = 16  # VLM LoRA rank
    lora_alpha: int = 32  # VLM LoRA alpha
    lora_dropout: float = 0.05  # VLM LoRA dropout (0 while --disable_dropout)
    disable_dropout: bool = field(default=True, metadata={
        "help": "every dropout rate of the VLM 0 (LoRA's too), so the text's log-probs agree between rollout (eval "
                "mode) and loss (train mode) and the ratio is 1 on a first pass; as train_grpo.py"})
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # VLM modules LoRA wraps
    generator_lora_r: int = 16  # generator LoRA rank (reference: adapters off); 0: full fine-tuning (a frozen copy)
    generator_lora_alpha: Optional[int] = None  # generator LoRA alpha; none: the rank
    max_pixels: Optional[int] = None  # max pixels per image for the VLM's image processor
    min_pixels: Optional[int] = None  # min pixels per image for the VLM's image processor
    max_anyres_num: Optional[int] = None  # unused by Qwen2.5-VL; kept for the shared model loader
    # data
    dataset_name: str = choice(*DATASETS, help="schema of the prompt files (prompts: a .txt of one prompt a line, or "
                                               "rows with a prompt column, as Flow-GRPO's PickScore and OCR sets)")
    train_data_path: str = field(default=TINY, metadata={
        "help": "jsonl of training prompts; 'tiny': synthetic shapes_t2i prompts"})
    val_data_path: Optional[str] = field(default=TINY, metadata={
        "help": "jsonl of held-out prompts (shapes_t2i: 'tiny'); none: no evaluation"})
    # rewards
    reward_fn: str = field(default="shapes_t2i", metadata={
        "help": "image reward: shapes_t2i, geneval, judge_geneval_plus, judge_tiif, the reward models pickscore, "
                "clipscore, aesthetic, hpsv2, imagereward, ocr, unifiedreward (docs/rewards.md), weighted (a weighted "
                "sum of several), or module:function"})
    reward_kwargs: dict = field(default_factory=dict, metadata={"help": "JSON options of --reward_fn"})
    reward_server_urls: str = "http://127.0.0.1"  # comma-separated reward server URLs (rank r: endpoint r mod n)
    reward_server_port: Optional[str] = "8000"  # comma-separated ports, combined with every URL; none: in the URLs
    allow_insecure_api_key: bool = field(default=False, metadata={"help": (
        "a judge reward may send its API key over plain http to a host other than 127.0.0.1 (refused otherwise: it "
        "travels in clear)")})
    format_weight: float = 1.0  # w_fmt: reason text reward = score * fmt + w_fmt * fmt (R3: 1.0)
    # model: Flow-GRPO (no text)
    text_free: bool = field(default=False, metadata={
        "help": "Flow-GRPO's setting: each prompt goes straight to the generator (its pipeline's own text encoder "
                "reads it); no VLM loads, nothing reasons or reflects, only the generator trains (it sets "
                "--reflect_refine false, --tune_text_cot false, --conditioning generator)"})
    overlap_rewards: bool = field(default=False, metadata={
        "help": "--text_free: a background thread scores step k's images while step k+1's are drawn (before step k "
                "trains, so they are one step off-policy; the clipped ratio corrects for it); a step that ends in a "
                "checkpoint draws no next images, so a resumed run repeats the run exactly"})
    # generation: groups (GRPO groups over processes)
    group_size: int = 16  # rollouts per prompt (the GRPO group)
    policy_group_size: int = 4  # processes sharing one prompt; each makes group_size // policy_group_size rollouts
    prompts_per_policy_group: int = 1  # prompts each policy group takes per step
    # generation: text (the VLM's reasoning)
    max_prompt_length: Optional[int] = 512  # max prompt tokens (longer: an error naming the row)
    max_output_token_n_gen: int = 196  # max reasoning tokens in the reason stage (R3: 196)
    temperature: float = 0.9  # text sampling temperature; behaviour and training log-probs use it too
    top_k: Optional[int] = None  # refused (R3 samples with top-k 50): its log-probs would not be the sampler's
    top_p: float = 1.0  # refused below 1 (R3 samples with top-p 0.9): its log-probs would not be the sampler's
    # generation: image (the generator's flow steps)
    image_size: int = 512  # height = width of the generated images
    num_timesteps_gen: int = 20  # flow steps of the reason stage's image
    enable_sde_gen: bool = True  # one SDE step per rollout (trained); off: ODE only, the image part is not trained
    noise_level_gen: float = 0.7  # SDE noise level a of the reason stage
    noise_cap: str = choice("flow_grpo", "r3", help="std_t rule at sigma = 1 (utils/t2i/sde.py)")
    cfg_scale_gen: float = 4.0  # text classifier-free guidance of the reason stage's image
    cfg_renorm_type_gen: str = choice(*RENORM_TYPES, help=(
        "rescale of the reason stage's guided velocity: pipeline (the pipeline's own: Qwen-Image rescales each latent "
        "token to the conditional norm), none, or BAGEL's clamped global / channel / text_channel (R3: global)"))
    cfg_renorm_min: float = 0.0  # lower clamp of BAGEL's renorm ratio (global / channel / text_channel; R3: 0)
    cfg_interval: list[float] = field(default_factory=lambda: [0.4, 1.0])  # CFG only for sigma in (lo, hi]
    negative_prompt: str = " "  # the CFG negative prompt (Qwen-Image's default)
    timestep_shift: Optional[float] = 3.0  # fixed shift t' = s t / (1 + (s - 1) t); none: the pipeline's own
    # generation: MixGRPO's sliding window (reason stage; W SDE steps per image, not R3's one random step)
    sde_window_size: int = 0  # W SDE steps per reason image, all trained; 0: R3's one random step (MixGRPO: 4)
    sde_window_shift_interval: int = 25  # reason steps before the window moves (MixGRPO's iters_per_group)
    sde_window_stride: Optional[int] = None  # steps the window moves by; none: its size (no overlap)
    sde_window_roll_back: bool = False  # past the last step, start again at step 0; false: stay at the end
    sde_window_range: Optional[list[int]] = field(default=None, metadata={
        "help": "Flow-GRPO-Fast: [lo, hi]: each step's window of --sde_window_size SDE steps starts at random in "
                "[lo, hi - size] (seeded by the step), ODE elsewhere (Flow-GRPO-Fast: [0, num_timesteps_gen // 2]); "
                "none: MixGRPO's sliding window"})
    # generation: reflect + refine (odd steps)
    reflect_refine: bool = True  # odd steps: reflect on a buffered reason image and refine it (same generator)
    max_output_token_n_edit: int = 384  # max tokens of the reflection + edit instruction (R3: 384)
    num_timesteps_edit: int = 20  # flow steps of the refine stage's image
    enable_sde_edit: bool = True  # one SDE step per refine rollout (trained); off: ODE refine, image not trained
    max_sde_timestep_idx_for_edit: int = 2  # the refine SDE step is one of the first N steps (R3: 2)
    noise_level_edit: float = 1.0  # SDE noise level a of the refine stage
    cfg_scale_edit: float = 4.0  # text classifier-free guidance of the refine stage (same interval)
    cfg_img_scale_edit: float = 1.5  # image CFG of the refine stage (BAGEL's cfg_img_scale; 1: off)
    cfg_renorm_type_edit: str = choice(*RENORM_TYPES, help=(
        "rescale of the refine stage's guided velocity (choices as --cfg_renorm_type_gen); text_channel (R3): the "
        "text-guided velocity per latent token before the image CFG"))
    perfect_buffer_prob: float = 0.15  # a reflect step draws from the perfect (score 1) pool with this probability
    # GRPO loss
    ce_weight: float = 1.0  # weight of the text part
    mse_weight: float = 2.0  # weight of the image part
    kl_weight_text: float = 1e-3  # k3 KL of the text to the reference VLM
    kl_weight_image: float = 1e-3  # KL of the SDE step to the reference generator
    clip_range_text: float = 0.2  # text ratio clipped to [1 - c, 1 + c]
    clip_range_image: float = 0.2  # image ratio clipped to [1 - c, 1 + c]
    tune_text_cot: bool = True  # train the VLM on the text part
    tune_image_cot: bool = True  # train the generator on the image part
    scale_advantages: bool = False  # divide advantages by the group's std (R3: off)
    # training
    learning_rate: float = 5e-6  # AdamW peak learning rate (the VLM; the generator too unless the next is set)
    generator_learning_rate: Optional[float] = None  # peak learning rate of the generator's LoRA; none: the above
    lr_scheduler_type: str = "constant_with_warmup"  # transformers LR schedule
    warmup_steps: float = 10  # linear LR warmup: a count of steps, or under 1 a share of them (R3: 10)
    adam_beta2: float = 0.95  # AdamW beta2 (R3's)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0: no clipping
    max_steps: int = 200  # optimizer steps
    seed: int = 42  # seed of data order, text sampling, initial noise and SDE noise
    max_unscored_steps: int = field(default=3, metadata={"help": (
        "stop when the reward scores none of a stage's images this many steps of that stage in a row")})
    # distributed
    cpu_threads: Optional[int] = None  # torch threads per process without a GPU; default: an even share
    # logging
    output_dir: str = "outputs/mixgrpo"  # checkpoints, metrics, grids and config.yaml
    logging_steps: int = 1  # log metrics every N steps
    report_to: str = "tensorboard"  # trackers: tensorboard, wandb, trackio, all or none
    log_completions: int = 4  # rollouts per logged step written to completions.jsonl
    # logging: held-out evaluation (greedy or --eval_temperature text, ODE image, more steps)
    eval_samples: Optional[int] = 64  # evaluate the first N held-out prompts; none: all
    eval_temperature: float = field(default=0.0, metadata={
        "help": "held-out reasoning and reflections: 0 greedy, > 0 sampled at this temperature from seeded noise "
                "(R3: 0.3)"})
    eval_num_timesteps: int = 30  # flow steps of the evaluation images
    eval_images_per_prompt: int = 1  # images per held-out prompt, each from its own noise (GenEval's protocol: 4)
    eval_refine_rounds: int = 1  # held-out reflect + refine rounds per image, each stops at "no further edit" (R3: 4)
    eval_batch_size: int = 16  # held-out images drawn and refined in one batch (a row's images go together)
    eval_steps: int = 0  # evaluate every N steps (0: only before and after training)
    eval_before: bool = True  # also evaluate the starting policy


def parse_args(argv=None):
    """The run's config: flags over --config's recipe, or over the tiny one (tiny.cache.tiny_recipe)."""
    models = ("model_name_or_path", "generator_name_or_path", "edit_generator_name_or_path")
    return parse_config(MixGRPOConfig, argv, default_recipe=tiny_recipe(TINY_MIXGRPO_RECIPE, *models))


def validate(cfg, num_processes):
    """Flag combinations that cannot work fail here, before anything is loaded."""
    check_optimizer_flags(cfg)
    if cfg.group_size < 2:
        raise ConfigError("--group_size must be >= 2 (a group of one has zero advantage)")
    if cfg.policy_group_size < 1 or cfg.group_size % cfg.policy_group_size:
        raise ConfigError(f"--group_size {cfg.group_size} is not a multiple of --policy_group_size "
                          f"{cfg.policy_group_size}")
    if num_processes % cfg.policy_group_size:
        raise ConfigError(f"{num_processes} processes do not split into policy groups of --policy_group_size "
                          f"{cfg.policy_group_size}")
    if cfg.prompts_per_policy_group < 1:
        raise ConfigError("--prompts_per_policy_group must be >= 1")
    if cfg.temperature <= 0:
        raise ConfigError("--temperature must be > 0 for GRPO sampling")
    if cfg.top_k or cfg.top_p < 1:
        raise ConfigError(f"--top_k {cfg.top_k} / --top_p {cfg.top_p}: truncated sampling is not supported, since the "
                          "behaviour and training log-probs are over the full tempered softmax, not the truncated "
                          "one that sampled (R3 samples truncated and trains on the full softmax)")
    if cfg.num_timesteps_gen < 2:
        raise ConfigError("--num_timesteps_gen must be >= 2 (the SDE step is one of the first N - 1)")
    if len(cfg.cfg_interval) != 2 or not 0 <= cfg.cfg_interval[0] < cfg.cfg_interval[1] <= 1:
        raise ConfigError(f"--cfg_interval {cfg.cfg_interval}: expected [lo, hi] with 0 <= lo < hi <= 1")
    if cfg.eval_refine_rounds < 1:
        raise ConfigError(f"--eval_refine_rounds {cfg.eval_refine_rounds} must be >= 1")
    if cfg.eval_batch_size < 1:
        raise ConfigError(f"--eval_batch_size {cfg.eval_batch_size} must be >= 1")
    if cfg.eval_images_per_prompt < 1:
        raise ConfigError(f"--eval_images_per_prompt {cfg.eval_images_per_prompt} must be >= 1")
    if not (cfg.tune_text_cot or cfg.tune_image_cot):
        raise ConfigError("--tune_text_cot and --tune_image_cot are both off: nothing to train")
    if cfg.tune_image_cot and not cfg.enable_sde_gen:
        raise ConfigError("--tune_image_cot needs --enable_sde_gen (ODE images carry no log-prob to train)")
    if not 0 <= cfg.sde_window_size <= cfg.num_timesteps_gen - 1:
        raise ConfigError(f"--sde_window_size {cfg.sde_window_size} must lie in [0, --num_timesteps_gen - 1 = "
                          f"{cfg.num_timesteps_gen - 1}] (the last step is never an SDE step)")
    if cfg.sde_window_size and (cfg.sde_window_shift_interval < 1 or (cfg.sde_window_stride or 1) < 1):
        raise ConfigError("--sde_window_shift_interval and --sde_window_stride must be >= 1")
    if cfg.reflect_refine and not 1 <= cfg.max_sde_timestep_idx_for_edit <= cfg.num_timesteps_edit:
        raise ConfigError(f"--max_sde_timestep_idx_for_edit {cfg.max_sde_timestep_idx_for_edit} must lie in [1, "
                          f"--num_timesteps_edit {cfg.num_timesteps_edit}]")
    if not 0 <= cfg.perfect_buffer_prob <= 1:
        raise ConfigError(f"--perfect_buffer_prob {cfg.perfect_buffer_prob} must lie in [0, 1]")
    if cfg.generator_lora_r < 0:
        raise ConfigError(f"--generator_lora_r {cfg.generator_lora_r} must be >= 0 (0: full fine-tuning)")
    if cfg.reward_fn not in REWARDS and ":" not in cfg.reward_fn:
        raise ConfigError(f"--reward_fn {cfg.reward_fn!r}: expected one of {REWARDS} or module:function")
    if cfg.dataset_name == "tiif" and cfg.reward_fn in REWARDS and cfg.reward_fn != "judge_tiif":
        raise ConfigError("--dataset_name tiif is scored by --reward_fn judge_tiif")
    if cfg.dataset_name != "tiif" and cfg.reward_fn == "judge_tiif":
        raise ConfigError("--reward_fn judge_tiif needs --dataset_name tiif (yes/no question lists)")
    for flag in ("train_data_path", "val_data_path"):
        if getattr(cfg, flag) == TINY and cfg.dataset_name != "shapes_t2i":
            raise ConfigError(f"--{flag} tiny is the shapes_t2i prompt set; give a file for --dataset_name "
                              f"{cfg.dataset_name}")
    if cfg.edit_generator_name_or_path and not cfg.reflect_refine:
        raise ConfigError("--edit_generator_name_or_path is set but --reflect_refine is off (nothing refines)")
    if cfg.cfg_img_scale_edit < 1:
        raise ConfigError(f"--cfg_img_scale_edit {cfg.cfg_img_scale_edit} must be >= 1 (1: no image CFG)")
    check_renorm_flags(cfg)
    if cfg.eval_temperature < 0:
        raise ConfigError(f"--eval_temperature {cfg.eval_temperature} must be >= 0 (0: greedy)")
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id")
    if cfg.overlap_rewards and not cfg.text_free:
        raise ConfigError("--overlap_rewards needs --text_free (Mix-GRPO's reflect stage reads the reason step's "
                          "scores at once)")
    if cfg.text_free and (cfg.reflect_refine or cfg.tune_text_cot or cfg.conditioning != "generator"):
        raise ConfigError("--text_free has no VLM: it runs with --reflect_refine false, --tune_text_cot false and "
                          "--conditioning generator")
    if cfg.sde_window_range is not None:
        lo, hi = (list(cfg.sde_window_range) + [None, None])[:2]
        if len(cfg.sde_window_range) != 2 or not cfg.sde_window_size or not (
                0 <= lo and lo + cfg.sde_window_size <= hi <= cfg.num_timesteps_gen - 1):
            raise ConfigError(f"--sde_window_range {cfg.sde_window_range}: expected [lo, hi] with a window of "
                              f"--sde_window_size {cfg.sde_window_size} (>= 1) inside it and hi <= --num_timesteps_gen "
                              f"- 1 = {cfg.num_timesteps_gen - 1}")
    if cfg.max_unscored_steps < 1:
        raise ConfigError(f"--max_unscored_steps {cfg.max_unscored_steps} must be >= 1")
    if cfg.allow_insecure_api_key and cfg.reward_fn not in JUDGES:
        raise ConfigError(f"--allow_insecure_api_key applies to the judge rewards ({', '.join(JUDGES)}), not "
                          f"--reward_fn {cfg.reward_fn}")


SEED_STREAMS = 8  # text, initial noise, SDE step pick, SDE noise, buffer draw, SDE window start; room for more


def seeds_for(seed, stream, step, indices):
    """Counter-based int64 seeds per (run seed, stream, step, index): the same on any number of processes. Each
    (seed, stream) pair has its own base, so no stream of one run seed is a stream of another."""
    if not 0 <= stream < SEED_STREAMS:
        raise ValueError(f"seed stream {stream} outside [0, {SEED_STREAMS})")
    return completion_seeds(seed * SEED_STREAMS + stream, step, indices)


def torch_generators(seeds, device):
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]


# ---- rollouts for this process: text, then images ----


@dataclass
class TextRollout(Record):
    """Texts sampled for this process's rollouts (`text_rollout`). [n, L]: n rollouts, L completion tokens."""

    batch: Any  # the encoded prompts
    ids: torch.Tensor  # [n, L] the sampled tokens, right-padded
    mask: torch.Tensor  # [n, L] 1 on sampled tokens
    texts: list  # the decoded texts
    old_logps: torch.Tensor  # [n, L] behaviour log-probs, at the sampling temperature
    global_ids: list  # each rollout's index in the step: prompt slot * group_size + its place in the group


@dataclass
class Rollout(TextRollout):
    """One step's rollouts on this process (`reason_rollout`, `reflect_rollout`): the texts, the images drawn from
    them and their rewards. The advantages, the reference's log-probs and the loss read it."""

    stage: str  # reason or reflect
    rows: list  # the prompt row of each rollout
    images: list  # each rollout's image (PIL); reflect: the refined image, or the buffered one where nothing edits
    cond: Any  # the drawn rollouts' image conditions (utils.t2i.generators), in `drawn` order
    drawn: list  # the rollouts whose image the generator drew
    steps: Optional[SDEStep]  # the recorded SDE steps, window position first, then image; None: ODE only
    step_image: Optional[torch.Tensor]  # the rollout of each recorded step
    sde_index: torch.Tensor  # [n] each rollout's first SDE step index
    scores: torch.Tensor  # [n] the reward function's score of each image; NaN: unscored
    formats: torch.Tensor  # [n] 1 where the text has R3's format
    text_rewards: torch.Tensor  # [n] the text part's reward (utils.t2i.r3_format)
    image_rewards: torch.Tensor  # [n] the image part's reward
    image_mask: torch.Tensor  # [n] 1 where the image part trains (reflect: 0 where nothing was edited)
    no_edit: Optional[torch.Tensor] = None  # reflect: [n] 1 where the reflection asked for no edit
    score_prev: Optional[torch.Tensor] = None  # reflect: [n] the buffered image's score


@dataclass
class Advantages:
    """The step's rewards of every process, placed by rollout index, and this process's advantages."""

    text_rewards: torch.Tensor  # [every process's rollouts]
    image_rewards: torch.Tensor  # [every process's rollouts]
    text_all: torch.Tensor  # [every process's rollouts] the text advantages
    text: torch.Tensor  # [n] this process's text advantages, on the device
    image: torch.Tensor  # [n] this process's image advantages (0 where the image part does not train)


def rollouts_per_process(cfg):
    """A prompt's rollouts on each process of its policy group: --group_size spread over --policy_group_size."""
    return cfg.group_size // cfg.policy_group_size


def rollout_ids(cfg, prompt_ids, rank_in_group):
    """This process's rollouts' indices in the step (prompt slot * group_size + its place in the group)."""
    per = rollouts_per_process(cfg)
    return [q * cfg.group_size + rank_in_group * per + j for q in prompt_ids for j in range(per)]


def text_rollout(cfg, step, global_ids, messages, images, max_new_tokens, *, policy, processor, accelerator,
                 stop_ids, suppress_ids, sample_ids):
    """Sample one completion per message (counter-based seeds per rollout) and its behaviour log-probs at the
    sampling temperature (R3 took them from the untempered softmax). `policy`: the plain log-prob wrapper."""
    tokenizer = processor.tokenizer
    batch = encode_prompts(processor, messages, images, sample_ids=sample_ids,
                           max_prompt_length=cfg.max_prompt_length).to(accelerator.device)
    ids, mask = generate_completions(policy.model, batch, row_seeds=seeds_for(cfg.seed, 0, step, global_ids),
                                     max_new_tokens=max_new_tokens, temperature=cfg.temperature,
                                     eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                                     suppress_token_ids=suppress_ids)
    texts = tokenizer.batch_decode(ids.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)
    with torch.no_grad():
        old_logps = policy(batch, ids, mask, cfg.temperature)
    return TextRollout(batch=batch, ids=ids, mask=mask, texts=texts, old_logps=old_logps, global_ids=global_ids)


def sde_window(cfg, step):
    """MixGRPO's sliding window for training step `step`: the reason stage's SDE step indices, W consecutive ones.
    It starts at step 0 and moves by --sde_window_stride every --sde_window_shift_interval reason steps; past the
    last full window (which ends at step num_timesteps_gen - 2) it stays there, or with --sde_window_roll_back
    starts again at 0. A function of the step alone, so a resumed run uses the same windows."""
    size, stride = cfg.sde_window_size, cfg.sde_window_stride or cfg.sde_window_size
    if cfg.sde_window_range is not None:  # Flow-GRPO-Fast: a random start in [lo, hi - size], the same on every process
        lo, hi = cfg.sde_window_range
        pick = torch.Generator().manual_seed(int(seeds_for(cfg.seed, 5, step, [0])[0]))
        start = int(torch.randint(lo, hi - size + 1, (1,), generator=pick))
        return list(range(start, start + size))
    reason_steps = step // 2 if cfg.reflect_refine else step  # reason steps before this one
    moves = reason_steps // cfg.sde_window_shift_interval
    last = cfg.num_timesteps_gen - 1 - size  # the last start whose window holds W steps
    if cfg.sde_window_roll_back:
        start = (moves % (last // stride + 1)) * stride  # the full windows at 0, stride, ... <= last, in turn
    else:
        start = min(moves * stride, last)
    return list(range(start, start + size))


def image_rollout(cfg, step, prompt_ids, cond, global_ids, *, gen, device, num_steps, sde_range, enable_sde,
                  noise_level, guidance, window=None, draw=None):
    """Images for each prompt's share: the group shares the initial noise and one SDE step index (uniform in
    [0, sde_range)), or with `window` (MixGRPO) the window's SDE steps; each rollout has its own SDE noise; every
    other step is ODE. The rollouts listed in `draw` (default: all) are drawn in one batch, each as it would be
    alone; `cond` holds their conditions, in `draw` order. Returns (PIL images of the drawn rollouts, steps, first
    SDE step index per rollout, the rollout of each step): steps are ordered window position first, then image."""
    per = rollouts_per_process(cfg)
    draw = list(range(len(prompt_ids) * per)) if draw is None else list(draw)
    noise, sde_steps = [], []
    for q in prompt_ids:
        noise_gen = torch.Generator(device=device).manual_seed(int(seeds_for(cfg.seed, 1, step, [q])[0]))
        noise.append(gen.prepare_latents(1, cfg.image_size, cfg.image_size, noise_gen))  # any layout
        pick = torch.Generator().manual_seed(int(seeds_for(cfg.seed, 2, step, [q])[0]))
        sde_steps.append(list(window) if window else [int(torch.randint(0, sde_range, (1,), generator=pick))])
    sde_index = torch.tensor([sde_steps[r // per][0] for r in range(len(prompt_ids) * per)], dtype=torch.float32)
    if not draw:
        return [], None, sde_index, None
    out = sample(gen, cond, num_steps=num_steps,
                 sde_steps=[sde_steps[r // per] for r in draw] if enable_sde else [], guidance=guidance,
                 noise_level=noise_level, noise_cap=cfg.noise_cap, shift=cfg.timestep_shift,
                 generator=torch_generators(seeds_for(cfg.seed, 3, step, [global_ids[r] for r in draw]), device),
                 latents=torch.cat([noise[r // per] for r in draw]), output_type="pil")
    if not out.steps:
        return out.images, None, sde_index, None
    return out.images, SDEStep.cat(out.steps), sde_index, torch.tensor(draw).repeat(len(out.steps))


def reason_rollout(cfg, step, prompt_ids, rows, *, rank_in_group, policy, processor, gen, accelerator, stop_ids,
                   suppress_ids, reward_fn):
    """Reason stage for this process's share of each of its prompts: reasoning, then an image conditioned on the
    prompt + reasoning. prompt_ids: global prompt slots; rollout j of this process is prompt * G + offset + j."""
    per, global_ids = rollouts_per_process(cfg), rollout_ids(cfg, prompt_ids, rank_in_group)
    local_rows = [rows[k] for k in range(len(prompt_ids)) for _ in range(per)]
    text = text_rollout(cfg, step, global_ids, [user_message(REASON_PROMPT.format(prompt=r["prompt"]))
                                                for r in local_rows],
                        [[] for _ in local_rows], cfg.max_output_token_n_gen, policy=policy, processor=processor,
                        accelerator=accelerator, stop_ids=stop_ids, suppress_ids=suppress_ids,
                        sample_ids=[repr(r["prompt"]) for r in local_rows])
    parsed = [reasoning_of(t) for t in text["texts"]]
    cond = image_condition(cfg, gen, local_rows, [reasoning for _, reasoning in parsed])
    images, steps, sde_index, step_image = image_rollout(
        cfg, step, prompt_ids, cond, global_ids, gen=gen, device=accelerator.device, num_steps=cfg.num_timesteps_gen,
        sde_range=cfg.num_timesteps_gen - 1, enable_sde=cfg.enable_sde_gen, noise_level=cfg.noise_level_gen,
        guidance=reason_guidance(cfg),
        window=sde_window(cfg, step) if cfg.sde_window_size else None)
    scores = score_images(cfg, reward_fn, text["texts"], images, local_rows)
    formats = torch.tensor([f for f, _ in parsed])
    text_r, image_r = reason_rewards(scores, formats, cfg.format_weight)
    return Rollout(**text, stage="reason", images=images, cond=cond.detach(), drawn=list(range(len(images))),
                   steps=steps, scores=scores, formats=formats, sde_index=sde_index, step_image=step_image,
                   rows=local_rows, text_rewards=text_r, image_rewards=image_r, image_mask=torch.ones(len(images)))


def prompt_rollout(cfg, step, prompt_ids, rows, *, rank_in_group, gen, accelerator, scorer):
    """Flow-GRPO (--text_free) for this process's share of each of its prompts: the prompt alone conditions the
    generator, no text is sampled. Returns (the rollout, its scores as a future: `scorer` scores at once, or in a
    background thread with --overlap_rewards); `with_scores` fills them in."""
    global_ids = rollout_ids(cfg, prompt_ids, rank_in_group)
    local_rows = [rows[k] for k in range(len(prompt_ids)) for _ in range(rollouts_per_process(cfg))]
    cond = image_condition(cfg, gen, local_rows, None)
    images, steps, sde_index, step_image = image_rollout(
        cfg, step, prompt_ids, cond, global_ids, gen=gen, device=accelerator.device, num_steps=cfg.num_timesteps_gen,
        sde_range=cfg.num_timesteps_gen - 1, enable_sde=cfg.enable_sde_gen, noise_level=cfg.noise_level_gen,
        guidance=reason_guidance(cfg),
        window=sde_window(cfg, step) if cfg.sde_window_size else None)
    n, texts = len(local_rows), [r["prompt"] for r in local_rows]
    no_text = torch.zeros(n, 0, dtype=torch.long, device=accelerator.device)  # the text part is empty
    unscored = torch.full((n,), float("nan"))
    roll = Rollout(batch=None, ids=no_text, mask=no_text, texts=texts, old_logps=None, global_ids=global_ids,
                   stage="image", rows=local_rows, images=images, cond=cond.detach(), drawn=list(range(n)),
                   steps=steps, step_image=step_image, sde_index=sde_index, scores=unscored, formats=torch.ones(n),
                   text_rewards=torch.zeros(n), image_rewards=unscored, image_mask=torch.ones(n))
    return roll, scorer.submit(texts, images, local_rows)


def with_scores(roll, pending):
    """The text-free rollout with its scores, waited for (a reward that failed raises here): image reward = score."""
    scores = pending.result()
    return replace(roll, scores=scores, image_rewards=scores)


def checkpoint_after(cfg, step):
    """Whether a checkpoint is written once `step` optimizer steps are done."""
    return is_due(step, cfg.save_steps, cfg.max_steps)


def build_buffer(accelerator, roll):
    """The reason step's (metadata, score, image) entries of all processes, in rollout order, split into the
    perfect (score 1) and imperfect pools (unscored images too: a refine of one is scored, its improvement is not).
    Every process holds the same buffer."""
    entries = [dict(id=int(i), row=r, score=float(s), image=im)  # `roll`: a Rollout, or any mapping of these fields
               for i, r, s, im in zip(roll["global_ids"], roll["rows"], roll["scores"], roll["images"])]
    gathered = sorted((e for part in gather_object([entries]) for e in part), key=lambda e: e["id"])
    return dict(perfect=[e for e in gathered if e["score"] >= 1.0],
                imperfect=[e for e in gathered if not e["score"] >= 1.0])  # NaN (unscored) included


def draw_entry(buffer, cfg, step, slot):
    """One buffer entry for a policy group's prompt slot: the perfect pool with probability
    --perfect_buffer_prob, else the imperfect one (the other pool when one is empty); seeded by (seed, step, slot)."""
    rng = torch.Generator().manual_seed(int(seeds_for(cfg.seed, 4, step, [slot])[0]))
    perfect = bool(torch.rand(1, generator=rng) < cfg.perfect_buffer_prob)
    pool = buffer["perfect"] if (perfect and buffer["perfect"]) or not buffer["imperfect"] else buffer["imperfect"]
    return pool[int(torch.randint(len(pool), (1,), generator=rng))]


def reflect_rollout(cfg, step, prompt_ids, buffer, *, rank_in_group, policy, processor, gen, accelerator, stop_ids,
                    suppress_ids, reward_fn):
    """Reflect + refine for this process's share: the VLM sees a buffered image and writes a reflection and an edit
    instruction (or "no further edit needed"); the generator refines the image through its image-conditioned path.
    With no edit the output is the input image, its score is kept and its image advantage is 0."""
    per, global_ids = rollouts_per_process(cfg), rollout_ids(cfg, prompt_ids, rank_in_group)
    entries = [draw_entry(buffer, cfg, step, q) for q in prompt_ids]
    local = [entries[k] for k in range(len(prompt_ids)) for _ in range(per)]
    rows = [e["row"] for e in local]
    text = text_rollout(cfg, step, global_ids, [user_message(REFLECT_PROMPT.format(prompt=r["prompt"]), True)
                                                for r in rows],
                        [[e["image"]] for e in local], cfg.max_output_token_n_edit, policy=policy, processor=processor,
                        accelerator=accelerator, stop_ids=stop_ids, suppress_ids=suppress_ids,
                        sample_ids=[f"buffer entry {e['id']}" for e in local])
    parsed = [reflection_of(t) for t in text["texts"]]
    no_edit = torch.tensor([keep for _, _, keep in parsed])
    edited = [i for i, keep in enumerate(no_edit.tolist()) if not keep]
    # A kept image is not drawn again; with no edit at all one image still is (and trained with advantage 0), so
    # every process runs the generator (ZeRO-3 gathers its weights in a collective).
    draw = edited or [0]
    cond = image_condition(cfg, gen, [rows[i] for i in draw], [parsed[i][1] for i in draw],
                           [local[i]["image"] for i in draw])
    refined, steps, sde_index, step_image = image_rollout(
        cfg, step, prompt_ids, cond, global_ids, gen=gen, device=accelerator.device,
        num_steps=cfg.num_timesteps_edit, sde_range=cfg.max_sde_timestep_idx_for_edit,
        enable_sde=cfg.enable_sde_edit, noise_level=cfg.noise_level_edit,
        guidance=edit_guidance(cfg), draw=draw)
    images = [e["image"] for e in local]
    for i, image in zip(edited, refined):
        images[i] = image
    prev = torch.tensor([e["score"] for e in local])
    scores = prev.clone()
    if edited:
        scores[edited] = score_images(cfg, reward_fn, [text["texts"][i] for i in edited], [images[i] for i in edited],
                                      [rows[i] for i in edited])
    formats = torch.tensor([f for f, _, _ in parsed])
    text_r, image_r = reflect_rewards(scores, prev, formats, no_edit, cfg.format_weight)
    return Rollout(**text, stage="reflect", images=images, cond=cond.detach(), drawn=draw, steps=steps,
                   scores=scores, formats=formats, sde_index=sde_index, step_image=step_image, rows=rows,
                   text_rewards=text_r, image_rewards=image_r, image_mask=(~no_edit).float(), no_edit=no_edit.float(),
                   score_prev=prev)


def scored_counts(accelerator, roll):
    """(images the reward was asked to score this step, images it scored), over every process: the reason stage
    and the text-free image stages score all their images, a refine only those it edited."""
    asked = torch.ones(len(roll.scores), dtype=torch.bool) if roll.no_edit is None else ~roll.no_edit.bool()
    counts = torch.tensor([asked.sum(), (asked & ~roll.scores.isnan()).sum()], device=accelerator.device)
    return accelerator.reduce(counts, "sum").tolist()


def gather_by_index(accelerator, values, global_ids, total):
    """Every process's per-rollout values placed at their global rollout index: [total] on every process."""
    ids = accelerator.gather(torch.tensor(global_ids, device=accelerator.device))
    vals = accelerator.gather(values.to(accelerator.device).float())
    out = torch.full((total,), float("nan"), device=accelerator.device)
    out[ids] = vals
    return out.cpu()


def step_condition(roll):
    """The rollout's condition with one row per recorded SDE step (a window records several per image); `cond` holds
    the drawn rollouts' conditions, in `drawn` order."""
    row = {r: k for k, r in enumerate(roll.drawn)}
    return roll.cond.select([row[int(r)] for r in roll.step_image])


def mixgrpo_loss(cfg, model, roll, adv_text, adv_image, *, ref_logps, ref_mean, text_tokens, n_images, world):
    """ce_weight * (token clipped surrogate / the step's text tokens + kl_weight_text * k3)
    + mse_weight * clipped surrogate on each image's SDE log-prob / the step's images + kl_weight_image * image KL.
    With a window of W SDE steps per image each step is one term with its image's advantage, and the image part is
    their mean (n_images x W terms). Normalisers span all processes (DDP averages the gradients, hence the world
    factor). `model`: the (prepared) MixGRPOModel, called once for both parts. Returns (loss, stats)."""
    loss, stats = torch.zeros((), device=roll.ids.device), {}
    train_image = cfg.tune_image_cot and roll.steps is not None
    out = model(text=(roll.batch, roll.ids, roll.mask, cfg.temperature, True) if cfg.tune_text_cot else None,
                image=(step_condition(roll), roll.steps) if train_image else None, edit=roll.stage == "reflect")
    if cfg.tune_text_cot:
        logps, entropy = out["text"]  # the policy's per-token entropy, from the same fused head pass
        text_loss, st = clipped_policy_loss(logps, roll.old_logps, adv_text, roll.mask,
                                            epsilon_low=cfg.clip_range_text, beta=cfg.kl_weight_text,
                                            ref_logps=ref_logps, loss_type="dapo", num_items_in_batch=text_tokens,
                                            num_processes=world, entropy=entropy)
        loss = loss + cfg.ce_weight * text_loss
        stats.update(loss_text=text_loss.detach(), kl_text=st["kl"], clip_ratio_text=st["clip_ratio"],
                     ratio_max_dev_text=st["ratio_max_dev"], entropy_text=st["entropy"],
                     entropy_high_frac_text=st["entropy_high_frac"])
    if train_image:
        steps, of = roll.steps, roll.step_image
        logp, mean, std = out["image"]
        ones = roll.image_mask[of].to(logp)[:, None]  # refine samples without an edit are not trained
        per_image = len(of) // len(of.unique())  # SDE steps recorded per drawn image (a window's W)
        n = torch.tensor(float(n_images * per_image), device=logp.device)
        adv = adv_image[of.to(adv_image.device)]  # each recorded step carries its image's advantage
        surrogate, st = clipped_policy_loss(logp[:, None], steps.log_prob[:, None], adv, ones,
                                            epsilon_low=cfg.clip_range_image, loss_type="dapo",
                                            num_items_in_batch=n, num_processes=world)
        kl = (image_kl(mean, ref_mean, std) if ref_mean is not None else torch.zeros_like(logp)) * ones[:, 0]
        # R3: mse_weight scales the surrogate only; the KL has its own weight
        image_loss = cfg.mse_weight * surrogate + cfg.kl_weight_image * kl.sum() / (n / world)
        loss = loss + image_loss
        stats.update(loss_image=image_loss.detach(), kl_image=kl.detach().sum() / ones.sum().clamp(min=1),
                     clip_ratio_image=st["clip_ratio"], ratio_max_dev_image=st["ratio_max_dev"])
    return loss, stats


# ---- the phases of a step, in the loop's order ----


def sample_rollout(cfg, step, slots, rows, buffer, *, mix, accelerator, gen, edit_gen, **kw):
    """Phase 1: this process's rollouts of the step, with every ZeRO-3 shard gathered once: the reason stage on `rows`
    (the prompts of its policy group's `slots`), or, with rows None, reflect + refine on entries of `buffer`."""
    mix.eval()
    with unwrap_for_generation(mix, accelerator) as plain:
        if rows is not None:
            return reason_rollout(cfg, step, slots, rows, policy=plain.text, gen=gen, accelerator=accelerator, **kw)
        return reflect_rollout(cfg, step, slots, buffer, policy=plain.text, gen=edit_gen, accelerator=accelerator,
                               **kw)


def advantages(accelerator, cfg, roll, total):
    """Phase 2: the text and image rewards of every process, placed by rollout index, and this process's
    group-normalised advantages (divided by the group's std with --scale_advantages)."""
    scale = "group" if cfg.scale_advantages else "none"
    text_rewards = gather_by_index(accelerator, roll.text_rewards, roll.global_ids, total)
    image_rewards = gather_by_index(accelerator, roll.image_rewards, roll.global_ids, total)
    local = torch.tensor(roll.global_ids)
    text_all = group_advantages(text_rewards, cfg.group_size, scale=scale)
    image = (group_advantages(image_rewards, cfg.group_size, scale=scale)[local] * roll.image_mask).to(
        accelerator.device)  # no edit: advantage 0
    return Advantages(text_rewards=text_rewards, image_rewards=image_rewards, text_all=text_all,
                      text=text_all[local].to(accelerator.device), image=image)


@torch.no_grad()
def reference_logprobs(cfg, mix, ref_policy, roll):
    """Phase 3: the reference's text log-probs (a frozen copy, or the VLM with its LoRA off) and the reference
    generator's mean at each recorded SDE step (LoRA off), where their KL terms are on; None where not."""
    text_ref = cfg.tune_text_cot and cfg.kl_weight_text
    image_ref = cfg.tune_image_cot and cfg.kl_weight_image and roll.steps is not None
    ref = mix(text=(roll.batch, roll.ids, roll.mask, cfg.temperature) if text_ref and ref_policy is None else None,
              image=(step_condition(roll), roll.steps) if image_ref else None, reference=True,
              edit=roll.stage == "reflect")
    ref_logps = ref_policy(roll.batch, roll.ids, roll.mask, cfg.temperature) if ref_policy else ref.get("text")
    return ref_logps, ref["image"][1] if image_ref else None


def optimizer_step(cfg, accelerator, mix, optimizer, roll, adv, *, ref_logps, ref_mean, total, guard, step):
    """Phase 4: `mixgrpo_loss` on this step's rollouts, backward, clipping at --max_grad_norm and one AdamW step on
    both parts, unless `guard` skips it (a non-finite loss or gradient norm on any process). Returns (loss, stats,
    the gradient norm before clipping or None, whether the step was taken)."""
    text_tokens = accelerator.reduce(roll.mask.sum().float(), "sum")
    mix.train()
    loss, stats = mixgrpo_loss(cfg, mix, roll, adv.text, adv.image, ref_logps=ref_logps, ref_mean=ref_mean,
                               text_tokens=text_tokens, n_images=total, world=accelerator.num_processes)
    clear_stale_zero3_gradients(accelerator, mix)  # the vision tower idles on reason steps (utils/core/zero3.py)
    accelerator.backward(loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm else None
    stepped = guard.step_ok(step, loss.detach(), grad_norm, params, optimizer)
    if stepped:
        optimizer.step()
    optimizer.zero_grad()
    return loss, stats, grad_norm, stepped


def log_step(accelerator, logger, cfg, step, roll, adv, loss, stats, grad_norm, *, total, learning_rate, step_time,
             skipped_steps=0):
    """Phase 5: the step's metrics row, under its stage's name (docs/mixgrpo.md), and its first --log_completions
    rollouts."""
    stage = roll.stage

    def gathered(values):
        return gather_by_index(accelerator, values, roll.global_ids, total)

    fmt, scores = gathered(roll.formats), gathered(roll.scores)
    metrics = {"loss": accelerator.reduce(loss.detach(), "mean").item(),
               f"{stage}/text_reward": adv.text_rewards.nanmean(),
               f"{stage}/image_reward": adv.image_rewards.nanmean(), f"{stage}/score": scores.nanmean(),
               f"{stage}/unscored": scores.isnan().float().mean(),
               f"{stage}/format": fmt.mean(),
               f"{stage}/text_advantage_abs": adv.text_all.abs().mean(),
               f"{stage}/image_advantage_abs": gathered(adv.image).abs().mean(),
               f"{stage}/completion_length": accelerator.gather(roll.mask.sum(-1)).float().mean(),
               f"{stage}/sde_step": roll.sde_index.mean(),
               "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
               "learning_rate": learning_rate, "step_time": step_time, "skipped_steps": skipped_steps}
    if stage == "reflect":
        metrics["reflect/no_edit"] = gathered(roll.no_edit).mean()
        metrics["reflect/improvement"] = (scores - gathered(roll.score_prev)).nanmean()
    for k, v in stats.items():
        reduced = accelerator.reduce(v.float(), "max" if k.startswith("ratio_max_dev") else "mean")
        metrics[f"{stage}/{k}"] = reduced.item()
    logger.log(step, metrics)
    logger.log_completions(step, [
        dict(id=int(i), stage=stage, prompt=r["prompt"], completion=t, score=float(s), text_reward=float(tr))
        for i, r, t, s, tr in zip(roll.global_ids, roll.rows, roll.texts, roll.scores, roll.text_rewards)
    ][: cfg.log_completions])


def save_step(accelerator, cfg, step, *, mix, processor, state, buffer, generators, logger, uploader, gen_path,
              vlm_path):
    """Phase 5: the checkpoint, atomic: both parts through the prepared MixGRPOModel, each trained generator part
    (its LoRA, or its whole transformer) and the reflect buffer beside them; then the push (the VLM at the
    repository's top, each generator part in its subfolder)."""
    kind = "lora" if cfg.generator_lora_r else "transformer"  # generator_lora/ or generator_transformer/
    loras = {f"{name}_{kind}": save_generator(accelerator, g, params, cfg.output_dir, f"{name}_{kind}")
             for name, g, params in generators}
    extra_saves = {**{name: (lambda d, src=src: os.replace(src, d)) for name, src in loras.items()},
                   **({"reflect_buffer": lambda d: save_buffer(buffer, d)} if buffer is not None else {})}
    save_and_push(accelerator, cfg, step, model=mix, processor=processor, state=state, logger=logger,
                  uploader=uploader, extra_saves=extra_saves, script="train_mixgrpo.py",
                  base_model=[p for p in (vlm_path, gen_path, cfg.edit_generator_name_or_path) if p],
                  parts=list(loras), notes=generator_card(cfg, gen_path, list(loras)))


def text_free_settings(cfg):
    """--text_free has no VLM: nothing reflects, no text trains, the generator's own encoder reads the prompt."""
    if not cfg.text_free:
        return cfg
    return replace(cfg, reflect_refine=False, tune_text_cot=False, conditioning="generator")


def main(cfg: MixGRPOConfig):
    cfg = text_free_settings(cfg)
    # The reason stage shows the VLM no image, so its vision tower gets no gradient there: DDP must allow that.
    accelerator = make_accelerator(cfg, find_unused_parameters=True)
    validate(cfg, accelerator.num_processes)
    seed_run(cfg)
    rank, world = accelerator.process_index, accelerator.num_processes
    G, P, K = cfg.group_size, cfg.policy_group_size, cfg.prompts_per_policy_group
    n_groups, group, member = world // P, rank // P, rank % P
    prompts_per_step = n_groups * K
    total = prompts_per_step * G  # rollouts per step, all processes

    # ---- data and reward (checked before any model is loaded) ----
    vlm_path, gen_path, edit_path, train_path, val_path = resolve_tiny_t2i(cfg, accelerator)
    cfg = replace(cfg, edit_generator_name_or_path=edit_path)  # 'tiny' -> its folder, for what reads it
    train_rows = load_prompts(cfg, train_path)
    val_rows = load_prompts(cfg, val_path) if val_path else None
    if val_rows is not None and cfg.eval_samples:
        val_rows = val_rows[: cfg.eval_samples]
    n_images = cfg.eval_images_per_prompt
    heldout_images = f"{len(val_rows or [])} prompts" + (f" x {n_images} images" if n_images > 1 else "")
    reward_fn = build_image_reward(cfg)
    check_generators(cfg, gen_path)  # their pipelines against the flags (model_index.json), before any loads
    if not cfg.text_free:
        check_policy(cfg, vlm_path, gen_path)  # the policy's family against the generator's conditioning

    # ---- the policy: the VLM (text) + the Qwen-Image generator conditioned on it ----
    # Both parts load whole on each process and ZeRO-3 shards them at prepare: diffusers builds no model sharded,
    # and the generator's frozen copy of the VLM (its conditioning) is copied from the loaded weights.
    with whole_weights(accelerator):
        if cfg.text_free:  # Flow-GRPO: the generator alone, its own text encoder reading the prompts
            model = processor = policy = stop_ids = suppress_ids = None
            gen, gen_params = load_generator(cfg, gen_path, "generator_name_or_path", accelerator.device, hidden=None,
                                             components=own_processor(gen_path), **cfg.generator_kwargs)
        else:
            model, processor, policy, gen, gen_params = build_policy(cfg, vlm_path, gen_path, accelerator.device)
    edit_gen, edit_params = gen, []  # the refine stage's generator: its own (Qwen-Image-Edit), or the same one
    if cfg.edit_generator_name_or_path:
        edit_gen, edit_params = build_edit_generator(cfg, cfg.edit_generator_name_or_path, gen, accelerator.device)
    if model is not None:
        stop_ids = stop_token_ids(model, processor.tokenizer)
        suppress_ids = special_token_ids_to_suppress(processor.tokenizer, stop_ids)
    if not cfg.tune_text_cot and policy is not None:
        policy.requires_grad_(False)
    if not cfg.tune_image_cot:
        for p in gen_params + edit_params:
            p.requires_grad_(False)
    groups = []
    if cfg.tune_text_cot:
        groups.append({"params": [p for p in policy.parameters() if p.requires_grad]})
    if cfg.tune_image_cot:
        groups.append({"params": gen_params + edit_params, "lr": cfg.generator_learning_rate or cfg.learning_rate})
    mix, optimizer, scheduler = prepare_training(
        accelerator, cfg, MixGRPOModel(policy, gen, edit_gen), groups, max_steps=cfg.max_steps,
        num_warmup_steps=num_warmup_steps(cfg, cfg.max_steps), micro_batch_size=K * (G // P))
    # The text's reference: the VLM with its LoRA off (MixGRPOModel's reference), or a frozen copy of it.
    ref_policy = (prepare_reference_model(cfg, vlm_path, policy, accelerator)
                  if cfg.kl_weight_text and cfg.tune_text_cot and not cfg.use_peft else None)

    # ---- resume ----
    state, resume_path = resume_run(accelerator, cfg)
    global_step = state.get("global_step", 0)
    guard = StepGuard(accelerator, cfg.max_skipped_steps)  # no optimizer step from a NaN or inf (utils/core/guards.py)
    unscored = UnscoredStreak(cfg.reward_fn, cfg.max_unscored_steps)  # a reward that scores nothing stops the run
    guard.load_state_dict(state.get("guard"))
    unscored.load_state_dict(state.get("unscored"))
    # the next step reflects on the checkpointed buffer
    buffer = load_buffer(os.path.join(resume_path, "reflect_buffer")) if resume_path else None
    sampler = SeededSampler(len(train_rows), seed=cfg.seed)
    if state:
        sampler.load_state_dict(state["sampler"])
    logger, uploader = start_logging(accelerator, cfg, total_steps=cfg.max_steps, start_step=global_step)
    mine = list(range(group * K, (group + 1) * K))  # global prompt slots of this policy group
    rollout_kw = dict(rank_in_group=member, processor=processor, gen=gen, edit_gen=edit_gen, accelerator=accelerator,
                      stop_ids=stop_ids, suppress_ids=suppress_ids, reward_fn=reward_fn)
    generators = [("generator", gen, gen_params)] + ([("edit_generator", edit_gen, edit_params)] if edit_params else [])

    def evaluate(tag):
        with unwrap_for_generation(mix, accelerator) as plain:  # ZeRO-3: every shard gathered once
            result = evaluate_reason(cfg, val_rows, policy=plain.text, processor=processor, gen=gen, edit_gen=edit_gen,
                                     accelerator=accelerator, stop_ids=stop_ids, suppress_ids=suppress_ids,
                                     reward_fn=reward_fn, grid_path=os.path.join(cfg.output_dir, f"heldout_{tag}.png"))
        logger.log(global_step, {f"heldout/{k}": v for k, v in result.items()})
        logger.log_image(global_step, f"heldout/{tag}", os.path.join(cfg.output_dir, f"heldout_{tag}.png"))
        return result

    scorer = RewardScorer(cfg, reward_fn, background=cfg.overlap_rewards)  # --text_free's scoring
    prefetched = None  # --overlap_rewards: the next step's rollout, drawn while this step's images are scored

    def draw_prompts(step):  # --text_free: `step`'s rollout, drawn with every ZeRO-3 shard gathered once
        prompt_idx = sampler.take(prompts_per_step)  # every process draws the same stream
        mix.eval()
        with unwrap_for_generation(mix, accelerator):
            return prompt_rollout(cfg, step, mine, [train_rows[prompt_idx[q]] for q in mine], rank_in_group=member,
                                  gen=gen, accelerator=accelerator, scorer=scorer)

    heldout_before = evaluate_before(accelerator, evaluate if val_rows is not None else None, state, cfg, global_step,
                                     describe=lambda r: f"held-out reward before: {r['reward']:.4f} ({heldout_images})")
    train_start = time.perf_counter()

    while global_step < cfg.max_steps:
        t_step = time.perf_counter()
        # ---- 1. rollout: even steps reason, odd steps reflect on a buffered image and refine it ----
        if cfg.text_free:  # Flow-GRPO: the prompt alone draws; a step before a checkpoint draws no next step
            (roll, pending), prefetched = prefetched or draw_prompts(global_step), None
            if cfg.overlap_rewards and not checkpoint_after(cfg, global_step + 1):
                prefetched = draw_prompts(global_step + 1)  # while this step's images are scored
            roll = with_scores(roll, pending)
        else:
            rows = None
            if not (cfg.reflect_refine and global_step % 2 == 1):
                prompt_idx = sampler.take(prompts_per_step)  # every process draws the same stream
                rows = [train_rows[prompt_idx[q]] for q in mine]
            roll = sample_rollout(cfg, global_step, mine, rows, buffer, mix=mix, **rollout_kw)
        unscored.update(roll.stage, global_step + 1, *scored_counts(accelerator, roll))
        if roll.stage == "reason" and cfg.reflect_refine:
            buffer = build_buffer(accelerator, roll)
        # ---- 2. rewards and advantages over whole policy groups (gathered across processes) ----
        adv = advantages(accelerator, cfg, roll, total)
        # ---- 3. the references' log-probs: a frozen copy, or the same weights with LoRA off ----
        ref_logps, ref_mean = reference_logprobs(cfg, mix, ref_policy, roll)
        # ---- 4. one optimizer step on both parts ----
        loss, stats, grad_norm, stepped = optimizer_step(cfg, accelerator, mix, optimizer, roll, adv, guard=guard,
                                                         step=global_step + 1, ref_logps=ref_logps,
                                                         ref_mean=ref_mean, total=total)
        if stepped:
            scheduler.step()
        global_step += 1

        # ---- 5. log, evaluate, checkpoint (atomic: both parts, optimizer, scheduler, sampler, RNG) and push ----
        if is_due(global_step, cfg.logging_steps, cfg.max_steps):
            log_step(accelerator, logger, cfg, global_step, roll, adv, loss, stats, grad_norm, total=total,
                     learning_rate=scheduler.get_last_lr()[0], step_time=time.perf_counter() - t_step,
                     skipped_steps=guard.skipped_steps)
        if val_rows is not None and cfg.eval_steps and global_step % cfg.eval_steps == 0 \
                and global_step < cfg.max_steps:
            evaluate(f"step{global_step}")
        if is_due(global_step, cfg.save_steps, cfg.max_steps):
            state = dict(global_step=global_step, sampler=sampler.state_dict(), heldout_before=heldout_before,
                         guard=guard.state_dict(), unscored=unscored.state_dict())
            save_step(accelerator, cfg, global_step, mix=mix, processor=processor, state=state, buffer=buffer,
                      generators=generators, logger=logger, uploader=uploader, gen_path=gen_path, vlm_path=vlm_path)

    scorer.close()
    summary = train_summary(global_step, train_start, logger)
    evaluate_after(accelerator, evaluate if val_rows is not None else None, summary, heldout_before,
                   summarize=heldout_summary,
                   describe=lambda after, before: heldout_lines(before, after, heldout_images) if before else [])
    finish_run(accelerator, cfg, logger, uploader, summary)
    return dict(policy=policy, gen=gen)


@contextlib.contextmanager
def whole_weights(accelerator):
    """Models built inside are whole: under a ZeRO-3 config transformers builds them sharded (deepspeed.zero.Init)
    while accelerate's HF DeepSpeed config is registered (its zero3_init_context_manager does not unregister it)."""
    if not is_zero3(accelerator):
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def save_generator(accelerator, gen, params, output_dir, name):
    """Write a generator's trained part, its LoRA (diffusers' adapter format) or its whole transformer (a diffusers
    model folder), to a staging folder of `output_dir` that the checkpoint then moves in; under ZeRO-3 its shards
    are gathered first, so every process calls this."""
    staging = os.path.join(output_dir, f"tmp-{name}")
    gather = contextlib.nullcontext()
    if is_zero3(accelerator):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(params))
    with gather:
        if accelerator.is_main_process:
            if os.path.isdir(staging):  # left by a crashed save
                shutil.rmtree(staging)
            if has_adapters(gen.transformer):
                gen.transformer.save_lora_adapter(staging)
            else:
                gen.transformer.save_pretrained(staging)
    return staging


def generator_card(cfg, gen_path, parts):
    """The model card's section on the generators: which pipeline each trained part (a checkpoint subfolder) belongs
    to, and the code that loads it."""
    if cfg.conditioning == "generator":
        reads = "The VLM above reasons and reflects; the generators read its text with their own text encoder:"
    else:
        reads = (f"The VLM above reasons and reflects; the {'base' if cfg.conditioning == 'base' else 'trained'} "
                 "weights of a VLM like it condition the generators (their pipelines' own text encoder, for "
                 "`--conditioning base`):")
    lines = ["## The image generators", "", reads, ""]
    code = ["```python", "from diffusers import DiffusionPipeline", ""]
    for name in parts:
        base, var = ((cfg.edit_generator_name_or_path, "edit") if name.startswith("edit_") else (gen_path, "pipe"))
        lora = name.endswith("_lora")
        lines.append(f"- `{name}/`: {'the LoRA' if lora else 'the fine-tuned transformer'} of `{base}`")
        code.append(f'{var} = DiffusionPipeline.from_pretrained("{base}")')
        if lora:
            code.append(f'{var}.transformer.load_lora_adapter("{cfg.hub_model_id}", subfolder="{name}", prefix=None,\n'
                        '    weight_name="pytorch_lora_weights.safetensors")')
        else:
            code.append(f'{var}.transformer = type({var}.transformer).from_pretrained("{cfg.hub_model_id}", '
                        f'subfolder="{name}")')
    return "\n".join(lines + [""] + code + ["```"])


BUFFER_POOLS = ("perfect", "imperfect")


def save_buffer(buffer, folder):
    """The reflect buffer, so that a run resumed before a reflect step reflects on the same images: each entry's
    id, row and score in buffer.json, its image's RGB or RGBA pixels (uint8 tensors, lossless: Qwen-Image 2.1's
    VAE decodes an alpha channel, which its refine reads) in images.pt. Nothing
    pickled, so `load_buffer` reads it with weights_only=True: a checkpoint from elsewhere cannot run code."""
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    meta = {pool: [dict(id=e["id"], row=e["row"], score=e["score"]) for e in buffer[pool]]
            for pool in BUFFER_POOLS}
    def lossless(im):
        return im if im.mode in ("RGB", "RGBA") else im.convert("RGB")

    pixels = {pool: [torch.from_numpy(np.array(lossless(e["image"]))) for e in buffer[pool]] for pool in BUFFER_POOLS}
    with open(os.path.join(folder, "buffer.json"), "w") as f:
        json.dump(meta, f)
    torch.save(pixels, os.path.join(folder, "images.pt"))


def load_buffer(folder):
    """The buffer `save_buffer` wrote, or None when `folder` holds none. Tensors only: a file holding any other
    object (a pickled buffer of older checkpoints included) is refused with an error naming it."""
    from PIL import Image

    legacy = os.path.join(folder, "buffer.pt")
    if os.path.isfile(legacy):
        raise InputError(f"{legacy}: a pickled reflect buffer, refused (unpickling can run code); delete it to "
                         "resume with a fresh buffer")
    meta_path, pixels_path = os.path.join(folder, "buffer.json"), os.path.join(folder, "images.pt")
    if not os.path.isfile(meta_path):
        return None
    try:
        pixels = torch.load(pixels_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses any object that is not a tensor or a plain container
        raise InputError(f"{pixels_path}: not a tensors-only file, refused ({str(exc).splitlines()[0]})") from None
    with open(meta_path) as f:
        meta = json.load(f)
    for pool in BUFFER_POOLS:
        if not isinstance(pixels.get(pool), list) or len(pixels[pool]) != len(meta.get(pool, [])):
            raise InputError(f"{pixels_path}: its {pool!r} images do not match {meta_path}'s entries")
    return {pool: [dict(id=e["id"], row=e["row"], score=e["score"],
                        image=Image.fromarray(px.numpy()))
                   for e, px in zip(meta[pool], pixels[pool])] for pool in BUFFER_POOLS}


if __name__ == "__main__":
    relaunch_multi_cpu_if_needed()
    watch_stage_parent()  # a stage of iterate.py ends with it, however it ends
    with exit_on_bad_input("train_mixgrpo.py"):  # bad input (data, model paths) ends in one line
        main(parse_args())
