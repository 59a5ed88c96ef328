"""The run skeleton the train scripts share, as plain functions called in this order from each script's main:

    accelerator = make_accelerator(cfg, ...)       # device, trackers of --report_to
    validate(cfg, ...)                             # the script's own flag checks (utils.core.config.ConfigError)
    seed_run(cfg)
    ... data, model ...
    model, optimizer, scheduler = prepare_training(accelerator, cfg, model, params, ...)
    state, resume_path = resume_run(accelerator, cfg)
    logger, uploader = start_logging(accelerator, cfg, ...)
    heldout_before = evaluate_before(accelerator, evaluate, state, cfg, global_step, describe=...)
    ... the training loop (in the script), each step ending with
        if is_due(step, cfg.logging_steps, max_steps): logger.log(step, ...)
        if is_due(step, cfg.save_steps, max_steps): save_and_push(accelerator, cfg, step, ...)
    summary = train_summary(...)
    evaluate_after(accelerator, evaluate, summary, heldout_before, summarize=..., describe=...)
    finish_run(accelerator, cfg, logger, uploader, summary, curves=...)

Three of these live beside what they do and are named here too: `train_summary` (utils.core.tracking),
`save_and_push` (utils.core.checkpoint), `evaluate_before` / `evaluate_after` (utils.eval.heldout, around the
script's own `evaluate(tag)`, a closure that returns a dict of results and logs them as the script does). What
differs between the scripts (the loop, the checkpoint contents, the evaluation itself) stays in the script.
"""

import os

from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from transformers import get_scheduler

from utils.core.checkpoint import load_checkpoint, resolve_resume
from utils.core.config import ConfigError, config_to_dict, save_config
from utils.core.fsdp import fsdp_layer_classes, init_adamw_state
from utils.core.hub import HubUploader
from utils.core.launch import accelerator_device_kwargs, set_cpu_threads
from utils.core.optim import build_optimizer
from utils.core.output_dir import claim_output_dir, is_fresh, release
from utils.core.precision import check_update_precision, deepspeed_master_weights
from utils.core.tracking import METRICS_FILE, RunLogger, plot_reward_curve, tracker_list, write_summary
from utils.core.tracking import train_summary as train_summary  # the skeleton's, re-exported: it lives with the logs


def make_accelerator(cfg, *, gradient_accumulation_steps=1, mixed_precision="no", find_unused_parameters=False):
    """The run's Accelerator, logging to the trackers of --report_to under --output_dir, its collectives timing out
    after --ddp_timeout seconds; then the run's claim on --output_dir (utils/core/output_dir.py: its lock, and no
    fresh run beside another run's files), before anything loads.

    Without a GPU: cpu=True, except under a DeepSpeed config (DS_ACCELERATOR=cpu); `accelerate launch --cpu` does
    not pass it on to the workers (utils.core.launch.accelerator_device_kwargs says why). `find_unused_parameters`: DDP
    allows parameters that get no gradient in a step (a part of the model a step does not use)."""
    check_run_flags(cfg)
    kwargs = accelerator_device_kwargs(ddp_timeout=cfg.ddp_timeout)
    if find_unused_parameters:
        kwargs["kwargs_handlers"] = kwargs.get("kwargs_handlers", []) + [
            DistributedDataParallelKwargs(find_unused_parameters=True)]
    accelerator = Accelerator(**kwargs, gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision=mixed_precision, log_with=tracker_list(cfg.report_to) or None,
                              project_dir=cfg.output_dir)
    claim_output_dir(accelerator, cfg)
    return accelerator


def check_run_flags(cfg):
    """The skeleton's own flags, refused before anything starts (one line naming the flag)."""
    for flag in ("ddp_timeout", "max_skipped_steps"):
        if getattr(cfg, flag) < 1:
            raise ConfigError(f"--{flag} {getattr(cfg, flag)} must be >= 1")
    if cfg.hub_private_repo and not cfg.push_to_hub:
        raise ConfigError("--hub_private_repo creates the repository --push_to_hub pushes to: give --push_to_hub")
    if cfg.overwrite_output_dir and not is_fresh(cfg.resume_from_checkpoint):
        raise ConfigError("--overwrite_output_dir deletes the run in --output_dir, which --resume_from_checkpoint "
                          "resumes: drop one")


def seed_run(cfg):
    """This process's share of the CPU cores (--cpu_threads), then --seed for python, numpy and torch."""
    set_cpu_threads(cfg.cpu_threads)
    set_seed(cfg.seed)


def prepare_training(accelerator, cfg, model, params, *, max_steps, num_warmup_steps, micro_batch_size,
                     **adamw_kwargs):
    """AdamW over `params` (tensors or parameter groups) by --optim at --learning_rate, --adam_beta1/2, --adam_epsilon
    and --weight_decay (utils.core.optim.build_optimizer; `adamw_kwargs` override them), the
    --lr_scheduler_type schedule over `max_steps`, then `model` and the optimizer prepared; the scheduler is
    checkpointed with them. Returns (model, optimizer, scheduler).

    Refused before anything trains: bf16/fp16 weights that plain AdamW steps at a learning rate under their rounding
    step (they would never move; utils/core/precision.py). The scheduler is stepped by hand once per optimizer step (it
    is not prepared), so the schedule does not depend on the number of processes. No DataLoader is prepared, so
    DeepSpeed learns the micro-batch (`micro_batch_size` per process) and --max_grad_norm from here."""
    optimizer = build_optimizer(params, cfg, **adamw_kwargs)
    check_update_precision(optimizer, master_weights=deepspeed_master_weights(accelerator))
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=num_warmup_steps,
                              num_training_steps=max_steps)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
        plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    if accelerator.distributed_type.name == "FSDP":  # the units: the models' layer classes (utils/core/fsdp.py)
        if accelerator.state.fsdp_plugin.activation_checkpointing and getattr(cfg, "gradient_checkpointing", False):
            raise ConfigError("--gradient_checkpointing: the FSDP config's fsdp_activation_checkpointing already "
                              "recomputes every layer's activations; keep one of the two")
        model._no_split_modules = fsdp_layer_classes(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    if accelerator.distributed_type.name == "FSDP":  # every checkpoint holds every parameter's state
        init_adamw_state(optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return model, optimizer, scheduler


def resume_run(accelerator, cfg):
    """Load --resume_from_checkpoint (a checkpoint folder, or latest in --output_dir): the prepared model, optimizer,
    scheduler and RNG states are restored in place. Returns (the script's saved `extra_state`, the checkpoint's
    path), or ({}, None) for a fresh run."""
    path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if not path:
        return {}, None
    state = load_checkpoint(accelerator, path)
    accelerator.print(f"resumed from {path} at step {state['global_step']}")
    return state, path


def start_logging(accelerator, cfg, *, total_steps, start_step):
    """config.yaml in --output_dir, the run's logger from `start_step` (metrics.jsonl, completions.jsonl, trackers,
    progress) and, with --push_to_hub, the background uploader of the main process (None elsewhere).
    Returns (logger, uploader)."""
    if accelerator.is_main_process:
        os.makedirs(cfg.output_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"))
    logger = RunLogger(cfg.output_dir, accelerator, report_to=cfg.report_to, config=config_to_dict(cfg),
                       total_steps=total_steps, start_step=start_step)
    uploader = (HubUploader(cfg.hub_model_id, private=cfg.hub_private_repo, staging_root=cfg.output_dir)
                if cfg.push_to_hub and accelerator.is_main_process else None)
    return logger, uploader


def is_due(step, every, last_step):
    """True at every `every`-th step and at the last one (--logging_steps, --save_steps, --eval_steps)."""
    return step % every == 0 or step == last_step


def finish_run(accelerator, cfg, logger, uploader, summary, curves=()):
    """Close the logs; on the main process draw `curves` ((png name, metric keys, smoothing) each) from
    metrics.jsonl, write train_summary.json and wait for the Hub uploads; then end the trackers."""
    logger.close()
    if accelerator.is_main_process:
        for png, keys, smoothing in curves:
            plot_reward_curve(os.path.join(cfg.output_dir, METRICS_FILE), os.path.join(cfg.output_dir, png),
                              keys=keys, smoothing=smoothing)
        write_summary(cfg.output_dir, summary)
        if uploader:
            uploader.wait()
    # every process leaves together: a rank that tore its process group down while another still ran its main-process
    # work above could abort at exit ("terminate called without an active exception", seen once under ZeRO-3)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    release(cfg.output_dir)
