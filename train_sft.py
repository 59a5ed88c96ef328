"""Supervised fine-tuning of a VLM (or LLM) on reasoning traces, in one readable script.

    accelerate launch train_sft.py                                        # tiny CPU recipe (warm start of tiny GRPO)
    accelerate launch --config_file accelerate_configs/zero3.yaml train_sft.py --config recipes/openvlthinker_sft.yaml

Loss: next-token NLL on assistant tokens only (system, user, image and padding tokens are masked, see
utils/core/sft_data.py), averaged over the assistant tokens of the whole optimizer step on all processes,
computed from the hidden states with `kernels.fused_token_logprobs` (no [tokens, vocab] logits).
Data: CRYSTAL VQA rows (`--dataset_format crystal`: the target is built from reference_steps + answer in
`--response_template` format) or sharegpt conversations (`--dataset_format sharegpt`, LLaMA-Factory /
OpenVLThinker SFT files). docs/sft.md has the details.
"""

import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional

from kernels import fused_token_logprobs
from tiny.cache import TINY_DATASET, TINY_MODEL, TINY_SFT_RECIPE, resolve_tiny, tiny_recipe
from utils.core.checkpoint import save_and_push
from utils.core.config import ConfigError, choice, parse_config
from utils.core.conversations import set_chat_template
from utils.core.data import load_sharegpt, load_vqa
from utils.core.data_sources import HubDatasetFlags, dataset_flags_error, train_rows, train_split
from utils.core.errors import exit_on_bad_input
from utils.core.flags import CheckpointFlags, HeldOutFlags, ImageVideoFlags, ModelFlags
from utils.core.guards import StepGuard
from utils.core.launch import relaunch_multi_cpu_if_needed, watch_stage_parent
from utils.core.logprobs import CompletionLogProbs, hf_core
from utils.core.models import freeze_vision_tower, load_model_and_processor, model_flags, prepare_for_training
from utils.core.optim import OptimizerFlags, check_optimizer_flags, num_warmup_steps
from utils.core.packing import packed_sequence_hidden, resolve_padding_free
from utils.core.prompts import PROMPT_TEMPLATES, RESPONSE_TEMPLATES
from utils.core.run import finish_run, is_due, make_accelerator, prepare_training, resume_run, seed_run, start_logging
from utils.core.samplers import SeededSampler
from utils.core.sft_data import (
    IGNORE_INDEX,
    encode_sft_batch,
    sharegpt_conversation,
    sharegpt_tools,
    vqa_conversation,
)
from utils.core.tracking import train_summary
from utils.core.video import budget_from_config, check_config_video_flags, videos_of
from utils.core.zero3 import clear_stale_zero3_gradients
from utils.eval.heldout import evaluate_after, evaluate_policy, load_eval_set


@dataclass
class SFTConfig(HeldOutFlags, CheckpointFlags, ImageVideoFlags, ModelFlags, HubDatasetFlags, OptimizerFlags):
    """Supervised fine-tuning of a VLM (or LLM) on reasoning traces: next-token NLL on the assistant tokens only,
    averaged over the assistant tokens of the whole optimizer step on all processes. Data: CRYSTAL VQA rows (the
    target built from reference_steps + answer in --response_template's format) or sharegpt conversations
    (LLaMA-Factory / OpenVLThinker SFT files). Flags override the recipe of --config; without one, the tiny CPU
    recipe (recipes/tiny_sft.yaml, the warm start of tiny GRPO) runs under the flags given, unless they name a model
    of their own. docs/sft.md has the details, docs/flags.md every flag."""

    # model
    model_name_or_path: str = field(default=TINY_MODEL,
                                    metadata={"help": "hub name or folder; 'tiny' builds the tiny VLM"})
    freeze_multi_modal_projector: bool = field(default=False,
                                               metadata={"help": "also freeze the vision-to-LM projector"})
    freeze_input_embeddings: bool = field(default=False, metadata={"help": (
        "keep the input token embeddings as loaded (with tied embeddings the LM head too): words that are random "
        "choices as targets otherwise drift together and can no longer be told apart as inputs")})
    padding_free: Optional[bool] = field(default=None, metadata={"help": (
        "pack each micro-batch's sequences end to end without padding (TRL's flag); none: where the model allows "
        "it, true: required, false: padded")})
    bf16: bool = False  # bf16 mixed precision (accelerate autocast)
    # data
    dataset_name: str = field(default=TINY_DATASET, metadata={
        "help": "hub name, save_to_disk folder or data file; 'synthetic:shapes' makes one"})
    dataset_split: Optional[str] = None  # alias of --dataset_train_split (TRL's name); none: that flag
    dataset_format: str = choice("crystal", "sharegpt",
                                 help="crystal: VQA rows with reference_steps; sharegpt: messages + images")
    response_template: str = choice(*RESPONSE_TEMPLATES,
                                    help="target format built from reference_steps + answer (crystal rows)")
    prompt_template: Optional[str] = field(default=None, metadata={
        "help": "system prompt template; default: the response template's"})
    system_prompt: Optional[str] = None  # replaces the template's system prompt; sharegpt: added where a row has none
    image_column: str = "image"  # column with the image(s) (crystal rows and the eval set)
    question_column: str = "question"  # column with the question (crystal rows and the eval set)
    answer_column: str = "answer"  # column with the answer (crystal rows and the eval set)
    steps_column: str = "reference_steps"  # column with the reference steps the target is built from (crystal)
    choices_column: Optional[str] = None  # column with answer options; none: 'choices' or 'options' when present
    messages_column: str = "messages"  # column with the conversation (sharegpt rows)
    images_column: str = "images"  # column with the image list (sharegpt rows)
    video_column: str = "video"  # column with the video(s) of crystal rows, when present (docs/data.md)
    videos_column: str = "videos"  # column with the video list of sharegpt rows, when present
    max_length: int = 1024  # max tokens per conversation; only its last assistant turn may be cut
    tools_column: str = "tools"  # column with the tool schemas of tool-use sharegpt rows, when present (docs/tools.md)
    chat_template_path: Optional[str] = field(default=None, metadata={"help": (
        "a .jinja file or a tokenizer folder whose chat template replaces the model's (TRL's flag), e.g. one with a "
        "tool format; none: the model's own")})
    # training
    per_device_train_batch_size: int = 8  # conversations per process per micro-batch
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    num_train_epochs: float = 1.0  # passes over the data when --max_steps <= 0 (may be fractional)
    max_steps: int = -1  # optimizer steps to run; <= 0: from --num_train_epochs
    learning_rate: float = 2e-5  # AdamW peak learning rate
    lr_scheduler_type: str = "linear"  # transformers LR schedule; constant ignores --warmup_ratio
    warmup_ratio: float = 0.0  # fraction of the steps with linear LR warmup
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # clip the gradient norm to this; 0: no clipping
    seed: int = 42  # seed of data order and init
    # distributed
    cpu_threads: Optional[int] = field(default=None, metadata={
        "help": "torch threads per process without a GPU; default: the cores shared evenly between this machine's "
                "processes"})
    # logging
    output_dir: str = "outputs/sft"  # checkpoints, logs, metrics and config.yaml go here
    logging_steps: int = 1  # log metrics every N optimizer steps
    report_to: Optional[str] = field(default="tensorboard",
                                     metadata={"help": "tensorboard, wandb, trackio, all or none"})
    # logging: checkpoints
    save_steps: int = 500  # checkpoint every N optimizer steps and at the end
    # logging: held-out evaluation (greedy answer accuracy on VQA rows)
    eval_steps: int = field(default=0, metadata={"help": "evaluate every N steps (0: only after training)"})


def parse_args(argv=None):
    """The run's config: flags over --config's recipe, or over the tiny one (tiny.cache.tiny_recipe)."""
    return parse_config(SFTConfig, argv, default_recipe=tiny_recipe(TINY_SFT_RECIPE, "model_name_or_path"))


def validate(cfg):
    """Every flag combination that cannot work fails here, before a model is loaded (one line naming the flag)."""
    if cfg.push_to_hub and not cfg.hub_model_id:
        raise ConfigError("--push_to_hub needs --hub_model_id")
    check_optimizer_flags(cfg)
    if dataset_flags_error(cfg):
        raise ConfigError(dataset_flags_error(cfg))
    if cfg.freeze_multi_modal_projector and not cfg.freeze_vision_tower:
        raise ConfigError("--freeze_multi_modal_projector needs --freeze_vision_tower (the projector is frozen with "
                          "it)")
    if cfg.prompt_template is not None and cfg.prompt_template not in PROMPT_TEMPLATES:
        raise ConfigError(f"--prompt_template {cfg.prompt_template!r} is not one of {list(PROMPT_TEMPLATES)}")
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "save_steps",
                 "logging_steps", "eval_batch_size"):
        if getattr(cfg, flag) < 1:
            raise ConfigError(f"--{flag} must be >= 1, got {getattr(cfg, flag)}")
    if cfg.eval_steps < 0:
        raise ConfigError(f"--eval_steps must be >= 0, got {cfg.eval_steps}")
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise ConfigError("set --max_steps or a positive --num_train_epochs")
    check_config_video_flags(cfg)
    if cfg.chat_template_path and not os.path.exists(cfg.chat_template_path):
        raise ConfigError(f"--chat_template_path {cfg.chat_template_path}: no such file or folder")


class AssistantNLL(CompletionLogProbs):
    """Wraps the model so that forward returns the summed NLL of the labelled (assistant) tokens.

    Everything runs inside forward, so DDP gradient hooks and ZeRO-3 gathering work (the LM head weight
    is registered with this module by CompletionLogProbs). Only labelled positions reach the head.
    """

    def forward(self, batch):
        core = hf_core(self.model)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.padding_free:
            hidden, _ = packed_sequence_hidden(core.base_model, inputs)
        else:
            out = core.base_model(**inputs, use_cache=False)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = core.get_output_embeddings()
        # The hidden state at position i predicts token i + 1.
        logps = fused_token_logprobs(hidden[:, :-1], head.weight, batch["labels"][:, 1:], bias=head.bias)
        return -logps.sum()


def load_train_rows(cfg, path, num_processes=1):
    """The training rows (--dataset_streaming: the rows the run reads, --max_steps x batch x accumulation x
    processes)."""
    path = train_rows(cfg, path, rows=cfg.max_steps * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                      * num_processes)
    if cfg.dataset_format == "sharegpt":
        return load_sharegpt(path, split=train_split(cfg), messages_column=cfg.messages_column,
                             images_column=cfg.images_column, videos_column=cfg.videos_column,
                             tools_column=cfg.tools_column)
    return load_vqa(path, split=train_split(cfg), image_column=cfg.image_column, question_column=cfg.question_column,
                    answer_column=cfg.answer_column, steps_column=cfg.steps_column, choices_column=cfg.choices_column,
                    video_column=cfg.video_column)


def conversation(cfg, row):
    if cfg.dataset_format == "sharegpt":
        return sharegpt_conversation(row, system_prompt=cfg.system_prompt)
    return vqa_conversation(row, response_template=cfg.response_template, prompt_template=cfg.prompt_template,
                            system_prompt=cfg.system_prompt)


def encode_micro_batch(cfg, sampler, dataset, processor, accelerator, video_budget):
    """The next B conversations of this process (every process draws the same indices and keeps its slice),
    encoded with their labels (utils.core.sft_data.encode_sft_batch)."""
    B, rank, world = cfg.per_device_train_batch_size, accelerator.process_index, accelerator.num_processes
    indices = sampler.take(B * world)[rank * B : (rank + 1) * B]
    rows = [dataset[i] for i in indices]
    conversations = [conversation(cfg, r) for r in rows]
    ids = [str(r.get("id", i)) for r, i in zip(rows, indices)]
    batch = encode_sft_batch(processor, [c[0] for c in conversations], [c[1] for c in conversations],
                             sample_ids=ids, max_length=cfg.max_length, videos=[videos_of(r) for r in rows],
                             video_budget=video_budget, tools=[sharegpt_tools(r) for r in rows])
    return batch.to(accelerator.device)


def optimisation_step(cfg, accelerator, policy, optimizer, micro_batches, step_tokens, guard, step):
    """Forward and backward over the step's micro-batches (gradients accumulated), clipping at --max_grad_norm, one
    AdamW step unless `guard` refuses it (a NaN or infinite loss or gradient norm, utils/core/guards.py). Returns
    (the step's loss on this process, the gradient norm before clipping or None, whether the optimizer stepped)."""
    world, GA = accelerator.num_processes, cfg.gradient_accumulation_steps
    policy.train()
    step_loss, grad_norm, stepped = 0.0, None, True
    clear_stale_zero3_gradients(accelerator, policy)  # a text-only step leaves the vision tower idle
    for batch in micro_batches:
        with accelerator.accumulate(policy):
            # DDP averages gradients over processes, so scale by the world size; accelerate divides by GA.
            loss = policy(batch) / step_tokens * world
            accelerator.backward(loss * GA)
            if accelerator.sync_gradients and cfg.max_grad_norm:
                grad_norm = accelerator.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            if accelerator.sync_gradients:
                stepped = guard.step_ok(step, step_loss + loss.detach() / world, grad_norm, policy.parameters(),
                                        optimizer)
            if stepped:
                optimizer.step()
            optimizer.zero_grad()
        step_loss += loss.detach() / world
    return step_loss, grad_norm, stepped


def main(cfg: SFTConfig):
    accelerator = make_accelerator(cfg, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                                   mixed_precision="bf16" if cfg.bf16 else "no")
    validate(cfg)
    seed_run(cfg)
    B, GA, world = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, accelerator.num_processes

    # ---- data (validated before any model is loaded) ----
    model_path, dataset_path = resolve_tiny(cfg, accelerator)
    dataset = load_train_rows(cfg, dataset_path, accelerator.num_processes)
    eval_set = load_eval_set(cfg, accelerator)
    eval_template = cfg.prompt_template or cfg.response_template

    # ---- model, optimiser ----
    model, processor = load_model_and_processor(model_path, **model_flags(cfg))
    set_chat_template(processor, cfg.chat_template_path)
    if cfg.freeze_multi_modal_projector:
        freeze_vision_tower(model, include_projector=True)
    # frames sampled and sized the same way at every step and in every process (utils/core/video.py)
    video_budget = budget_from_config(processor, cfg) if "videos" in dataset.column_names else None
    model = prepare_for_training(model, cfg)
    policy = AssistantNLL(model, padding_free=resolve_padding_free(cfg.padding_free, model, accelerator.print))
    steps_per_epoch = math.ceil(len(dataset) / (B * world * GA))
    max_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    policy, optimizer, scheduler = prepare_training(
        accelerator, cfg, policy, [p for p in policy.parameters() if p.requires_grad], max_steps=max_steps,
        num_warmup_steps=num_warmup_steps(cfg, max_steps), micro_batch_size=B)

    # ---- resume ----
    state, _ = resume_run(accelerator, cfg)
    global_step = state.get("global_step", 0)
    guard = StepGuard(accelerator, cfg.max_skipped_steps)
    guard.load_state_dict(state.get("guard"))
    sampler = SeededSampler(len(dataset), seed=cfg.seed)
    if state:
        sampler.load_state_dict(state["sampler"])
    logger, uploader = start_logging(accelerator, cfg, total_steps=max_steps, start_step=global_step)

    def evaluate(tag):  # greedy held-out accuracy; the trained model's is logged (a step's joins its row)
        result = evaluate_policy(policy, processor, eval_set, cfg, accelerator, prompt_template=eval_template)
        if tag == "after":
            logger.log(global_step, {f"heldout_{k}": v for k, v in result.items()})
        return result

    train_start = time.perf_counter()
    while global_step < max_steps:
        step_start = time.perf_counter()
        # ---- 1. this step's GA micro-batches; every process draws the same indices and keeps its slice ----
        micro_batches = [encode_micro_batch(cfg, sampler, dataset, processor, accelerator, video_budget)
                         for _ in range(GA)]
        # The loss is a mean over the assistant tokens of the whole step, on all processes.
        local_tokens = sum((b["labels"][:, 1:] != IGNORE_INDEX).sum() for b in micro_batches)
        step_tokens = accelerator.reduce(local_tokens.float(), "sum").clamp(min=1.0)
        # ---- 2. forward/backward, one optimizer step ----
        step_loss, grad_norm, stepped = optimisation_step(cfg, accelerator, policy, optimizer, micro_batches,
                                                          step_tokens, guard, global_step + 1)
        if stepped:
            scheduler.step()
        global_step += 1

        # ---- 3. held-out accuracy, log ----
        metrics = {}
        if eval_set is not None and cfg.eval_steps and global_step % cfg.eval_steps == 0 and global_step < max_steps:
            metrics.update({f"heldout_{k}": v for k, v in evaluate(f"step{global_step}").items()})
        if is_due(global_step, cfg.logging_steps, max_steps) or metrics:
            metrics.update({
                "loss": accelerator.reduce(step_loss, "sum").item(),
                "learning_rate": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "tokens": step_tokens.item(),
                "step_time": time.perf_counter() - step_start,
                "skipped_steps": guard.skipped_steps,
            })
            logger.log(global_step, metrics)

        # ---- 4. checkpoint (atomic) and push ----
        if is_due(global_step, cfg.save_steps, max_steps):
            save_and_push(accelerator, cfg, global_step, model=policy, processor=processor,
                          state=dict(global_step=global_step, sampler=sampler.state_dict(), guard=guard.state_dict()),
                          logger=logger, uploader=uploader, base_model=model_path, script="train_sft.py")

    summary = train_summary(global_step, train_start, logger)
    evaluate_after(accelerator, evaluate if eval_set is not None else None, summary, None,
                   summarize=lambda after, _: {f"heldout_{k}": v for k, v in after.items()},
                   describe=lambda r, _: [f"held-out accuracy {r['accuracy']:.3f} ({r['samples']} questions, "
                                          f"format {r['format']:.3f})"])
    curves = [("loss_curve.png", ["loss"], 0.8)]
    if eval_set is not None:
        curves.append(("heldout_curve.png", ["heldout_accuracy"], 0.0))
    finish_run(accelerator, cfg, logger, uploader, summary, curves=curves)
    return policy


if __name__ == "__main__":
    relaunch_multi_cpu_if_needed()
    watch_stage_parent()  # a stage of iterate.py ends with it, however it ends
    with exit_on_bad_input("train_sft.py"):  # bad input (data, prompts, model paths) ends in one line
        main(parse_args())
