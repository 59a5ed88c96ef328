"""TRL's GRPOConfig flags that train_grpo.py has no flag of its own for: each is accepted where it runs here as it
does in TRL (TRL's default, or a value that means what this script does), handed to the flag of ours that does the
same job, or refused in one line saying why. So a TRL user's command line (or `GRPOConfig.to_dict()`, flag for
flag) never fails on an unknown flag: it runs, or names what to change.

A flag the script's own config declares is the script's (this table is consulted only for names it does not know);
docs/flags.md lists the table under each script that reads it.
"""

import ast
import dataclasses
import json

_NONE = {"none", "null"}


@dataclasses.dataclass(frozen=True)
class TRLFlag:
    """How one TRL flag is read here: `accepts` are the values that run as in TRL (TRL's default first); `field` is
    our flag that takes the value instead; `any_value` accepts every value (it changes nothing here that TRL's
    would, `reason` says why); otherwise a value outside `accepts` is refused with `reason`."""

    reason: str
    accepts: tuple = ()
    field: str | None = None
    any_value: bool = False


def _no(reason, *accepts):
    return TRLFlag(reason, accepts=accepts)


def _same(field, reason=""):
    return TRLFlag(reason or f"the same as --{field}", field=field)


def _inert(reason):
    return TRLFlag(reason, any_value=True)


_NO_DATALOADER = "rows are drawn by the script's own checkpointed sampler, not a DataLoader"
_NO_EVAL_LOOP = ("held-out evaluation runs before and after training (--eval_dataset_name, --eval_before), "
                 "validation at every checkpoint (--val_split); evaluate.py scores any checkpoint")
_LAUNCHER = "the launcher's accelerate config sets it (accelerate_configs/, --config_file)"
_HUB = "checkpoints are pushed by --push_to_hub to --hub_model_id"

TRL_ONLY_FLAGS = {
    # optimisation
    "lr_scheduler_kwargs": _no("extra scheduler arguments are not passed; choose --lr_scheduler_type", None, {}),
    "optim_args": _no("the optimizer takes --learning_rate, --adam_beta1/2, --adam_epsilon, --weight_decay", None, ""),
    "optim_target_modules": _no("used by GaLore / APOLLO optimizers only, which are not wired in", None, []),
    "average_tokens_across_devices": _no("--loss_type dapo normalises over the tokens of all processes; the other "
                                         "loss types are per process, as in TRL", True),
    "label_smoothing_factor": _no("GRPO's loss has no labels to smooth", 0.0),
    "activation_checkpointing": _same("gradient_checkpointing"),
    "activation_checkpointing_kwargs": _no("activation checkpointing is non-reentrant here; no other options",
                                           None, {}, {"use_reentrant": False}),
    "gradient_checkpointing_kwargs": _no("activation checkpointing is non-reentrant here; no other options",
                                         None, {}, {"use_reentrant": False}),
    "auto_find_batch_size": _no("the batch is --per_device_train_batch_size; it is not searched", False),
    "neftune_noise_alpha": _no("NEFTune embedding noise is an SFT technique; not applied here", None),
    "torch_empty_cache_steps": _no("the CUDA cache is not emptied on a schedule", None),
    # precision and compilation
    "fp16": _no("fp16 mixed precision needs a loss scaler; use --bf16", False),
    "bf16_full_eval": _no("evaluation runs in the training dtype", False),
    "fp16_full_eval": _no("evaluation runs in the training dtype", False),
    "tf32": _no("TF32 matmuls are left at torch's setting", None),
    "torch_compile": _no("the model is not compiled; --cache_implementation static compiles the decode step", False),
    "torch_compile_backend": _no("the model is not compiled (see --torch_compile)", None),
    "torch_compile_mode": _no("the model is not compiled (see --torch_compile)", None),
    "use_liger_kernel": _no("the LM head's log-probs already run in kernels/logprob.py (fused, chunked); Liger is "
                            "not used", False),
    "liger_kernel_config": _no("Liger is not used (see --use_liger_kernel)", None),
    "cast_lm_head_to_fp32": _no("the fused log-prob kernel keeps its softmax statistics in fp32 already; the head's "
                                "weights keep --dtype", False),
    "use_cache": _inert("the KV cache is used in generation and not in training passes, whatever this says"),
    # logging and tracking
    "logging_strategy": _no("metrics are logged every --logging_steps optimizer steps", "steps"),
    "logging_first_step": _inert("metrics are logged at every multiple of --logging_steps (step 1 included when "
                                 "it is 1)"),
    "log_on_each_node": _inert("the main process logs"),
    "logging_nan_inf_filter": _inert("non-finite losses stop the step instead of being filtered from the logs"),
    "include_num_input_tokens_seen": _inert("completion and prompt lengths are logged every step"),
    "log_level": _inert("the scripts print their own progress"),
    "log_level_replica": _inert("the scripts print their own progress"),
    "disable_tqdm": _inert("the progress bar follows the terminal"),
    "skip_memory_metrics": _inert("memory is not traced per step"),
    "debug": _no("torch debug modes are not switched on by a flag", [], "", None),
    "run_name": _inert("trackers name the run after --output_dir"),
    "project": _inert("trackers name the run after --output_dir"),
    "trackio_space_id": _no("trackio is not one of the trackers here (--report_to)", None),
    "trackio_bucket_id": _no("trackio is not one of the trackers here (--report_to)", None),
    "trackio_static_space_id": _no("trackio is not one of the trackers here (--report_to)", None),
    "log_multimodal": _inert("completions.jsonl records each completion's prompt and image files"),
    "log_unique_prompts": _inert("completions.jsonl records every prompt"),
    "log_completions_hub_repo": _no("completions are written to completions.jsonl in --output_dir", None),
    # evaluation inside training
    "eval_strategy": _no(_NO_EVAL_LOOP, "no"),
    "eval_steps": _inert("no periodic evaluation (--eval_strategy no)"),
    "eval_delay": _inert("no periodic evaluation (--eval_strategy no)"),
    "eval_on_start": _same("eval_before", "the held-out evaluation before training (--eval_before)"),
    "per_device_eval_batch_size": _same("eval_batch_size", "prompts per generation batch of the held-out "
                                                           "evaluation (--eval_batch_size)"),
    "prediction_loss_only": _inert("no periodic evaluation (--eval_strategy no)"),
    "eval_do_concat_batches": _inert("no periodic evaluation (--eval_strategy no)"),
    "eval_use_gather_object": _inert("no periodic evaluation (--eval_strategy no)"),
    "eval_accumulation_steps": _inert("no periodic evaluation (--eval_strategy no)"),
    "include_for_metrics": _no(_NO_EVAL_LOOP, [], None),
    "batch_eval_metrics": _no(_NO_EVAL_LOOP, False),
    "num_generations_eval": _no("held-out evaluation draws one greedy answer per question", None),
    "greater_is_better": _no("the validation metrics of --metric_for_best_model are all higher-is-better", None, True),
    # checkpoints and the hub
    "save_strategy": _no("a checkpoint is written every --save_steps optimizer steps and at the end (resume needs "
                         "them)", "steps"),
    "save_only_model": _no("a checkpoint keeps the optimizer, scheduler and sampler so that resume is exact", False),
    "save_on_each_node": _no("the main process writes the checkpoint (on shared storage)", False),
    "enable_jit_checkpoint": _no("checkpoints are written every --save_steps and at the end", False),
    "ignore_data_skip": _no("resume restores the sampler's position exactly; nothing is skipped", False),
    "restore_callback_states_from_checkpoint": _no("there are no Trainer callbacks", False),
    "hub_token": _no("the token comes from HF_TOKEN or `hf auth login` (a flag would be written to config.yaml)",
                     None, "<HUB_TOKEN>"),
    "hub_strategy": _no(_HUB + " at every checkpoint", "every_save"),
    "hub_always_push": _no(_HUB + "; a push still running is waited for", False),
    "hub_revision": _no(_HUB + " on its main branch", None),
    # data order
    "data_seed": _no("the data order follows --seed", None),
    "full_determinism": _no("sampling is counter-based and exact across world sizes; torch's deterministic "
                            "kernels are not forced", False),
    "dataloader_drop_last": _inert(_NO_DATALOADER),
    "dataloader_num_workers": _inert(_NO_DATALOADER),
    "dataloader_pin_memory": _inert(_NO_DATALOADER),
    "dataloader_persistent_workers": _inert(_NO_DATALOADER),
    "dataloader_prefetch_factor": _inert(_NO_DATALOADER),
    "dataloader_multiprocessing_context": _inert(_NO_DATALOADER),
    "dataloader_in_order": _inert(_NO_DATALOADER),
    "remove_unused_columns": _no("every dataset column reaches the reward functions", False),
    "label_names": _no("GRPO's batches have no labels", None, []),
    "length_column_name": _inert("rows are not grouped by length"),
    "train_sampling_strategy": _no("prompts are drawn in a seeded random order (or the curriculum's)", "random"),
    # devices and distribution
    "use_cpu": _inert("the device comes from the launcher (accelerate launch --cpu, CUDA_VISIBLE_DEVICES)"),
    "accelerator_config": _no(_LAUNCHER, None, {}, {
        "split_batches": False, "dispatch_batches": None, "even_batches": True, "use_seedable_sampler": True,
        "non_blocking": False, "gradient_accumulation_kwargs": None}),
    "parallelism_config": _no(_LAUNCHER, None),
    "ddp_find_unused_parameters": _no(_LAUNCHER + "; unused parameters are found where a flag needs it", None),
    "ddp_bucket_cap_mb": _no(_LAUNCHER, None),
    "ddp_broadcast_buffers": _no(_LAUNCHER, None),
    "ddp_static_graph": _no(_LAUNCHER, None),
    "ddp_backend": _no(_LAUNCHER, None),
    "fsdp": _no("FSDP2 comes from accelerate_configs/fsdp2.yaml", None, "", []),
    "fsdp_config": _no("FSDP2 comes from accelerate_configs/fsdp2.yaml", None, {}),
    "deepspeed": _no("DeepSpeed comes from accelerate_configs/zero2.yaml or zero3.yaml", None, ""),
    "local_rank": _inert("the launcher sets each process's rank"),
    "do_train": _inert("the script trains"),
    "do_eval": _inert("held-out evaluation follows --eval_dataset_name"),
    "do_predict": _inert("there is no prediction step"),
    "ds3_gather_for_generation": _no("generation under ZeRO-3 runs on gathered weights (no per-token collective)",
                                     True),
    # model loading
    "model_init_kwargs": _no("the model loads with --dtype and --attn_implementation", None, {}),
    "trust_remote_code": _no("models load through transformers' own classes; remote code is not run", False),
    "router_aux_loss_coef": _no("no mixture-of-experts auxiliary loss is added", None),
    # generation
    "shuffle_dataset": _no("prompts are drawn in a seeded random order", True),
    "pad_to_multiple_of": _no("training passes are packed or padded to the longest row", None),
    "min_p": _no("the sampler applies --top_k / --top_p only; min-p is not applied", None, 0.0),
    "generation_kwargs": _no("generation takes --temperature, --top_k, --top_p and --max_completion_length only: "
                             "other keywords would sample a distribution the training log-probs do not score",
                             None, {}),
    "chat_template_kwargs": _no("prompts render with the chat template's defaults (--chat_template_path replaces it)",
                                None, {}),
    "repetition_penalty": _no("a penalty would sample a distribution the training log-probs do not score", 1.0),
    "use_transformers_continuous_batching": _no("the HF rollout is our lean decoding loop (or --use_vllm)", False),
    "transformers_continuous_batching_config": _no("the HF rollout is our lean decoding loop (or --use_vllm)", None),
    "use_transformers_paged": _no("the HF rollout is our lean decoding loop (or --use_vllm)", False),
    # loss variants
    "delta": _no("two-sided clipping is not implemented; the ratio is clipped to [1 - epsilon, 1 + epsilon_high]",
                 None),
    "sapo_temperature_neg": _inert("used by --loss_type sapo only, which is not implemented"),
    "sapo_temperature_pos": _inert("used by --loss_type sapo only, which is not implemented"),
    "vespo_k_pos": _inert("used by --loss_type vespo only, which is not implemented"),
    "vespo_lambda_pos": _inert("used by --loss_type vespo only, which is not implemented"),
    "vespo_k_neg": _inert("used by --loss_type vespo only, which is not implemented"),
    "vespo_lambda_neg": _inert("used by --loss_type vespo only, which is not implemented"),
    "multi_objective_aggregation": _no("rewards are weighted and summed, then normalised per group",
                                       "sum_then_normalize"),
    "use_adaptive_entropy": _no("the entropy bonus is --entropy_coef, fixed", False),
    "entropy_coef_min": _inert("used by --use_adaptive_entropy only"),
    "entropy_coef_max": _inert("used by --use_adaptive_entropy only"),
    "entropy_coef_delta": _inert("used by --use_adaptive_entropy only"),
    "entropy_target": _inert("used by --use_adaptive_entropy only"),
    "off_policy_mask_threshold": _no("off-policy sequence masking is not implemented", None),
    "vllm_importance_sampling_clip_max": _same("vllm_importance_sampling_cap", "the largest importance weight kept "
                                                                                "(--vllm_importance_sampling_cap)"),
    "vllm_importance_sampling_clip_min": _no("importance weights are capped from above only", None),
}


def parse_value(raw):
    """A TRL flag's value as typed (CLI tokens, a YAML value, or `to_dict()`'s) in plain Python: None, bools,
    numbers, JSON lists and dicts, an enum's value ("IntervalStrategy.STEPS" -> "steps"), else the string."""
    if isinstance(raw, (list, tuple)):
        if len(raw) == 1 and isinstance(raw[0], str):
            return parse_value(raw[0])
        return [parse_value(item) for item in raw]
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    lower = text.lower()
    if lower in _NONE:
        return None
    if lower in ("true", "false"):  # not yes/no: "no" is a value of TRL's strategies
        return lower == "true"
    if text[:1] in "[{(":  # JSON, or Python's repr of a list / dict (str() of TRL's value)
        for parse in (json.loads, ast.literal_eval):
            try:
                return parse(text)
            except (ValueError, SyntaxError):
                pass
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    head, dot, tail = text.partition(".")
    if dot and head[:1].isupper() and head.isidentifier() and tail.isidentifier():
        return tail.lower()
    return text


def trl_flag_values(name, raw, error=ValueError):
    """{our flag: value} that TRL's `--name raw` sets here ({} when it changes nothing); raises `error` (the scripts'
    ConfigError) with the reason when the value cannot run as it would in TRL."""
    rule = TRL_ONLY_FLAGS[name]
    value = parse_value(raw)
    if rule.field is not None:
        return {rule.field: value}
    if rule.any_value or any(_equal(value, accepted) for accepted in rule.accepts):
        return {}
    shown = " ".join(map(str, raw)) if isinstance(raw, (list, tuple)) else raw  # as typed
    default = rule.accepts[0] if rule.accepts else None
    raise error(f"--{name} {shown}: {rule.reason} (TRL's flag; only {default!r} runs here)")


def _equal(value, accepted):
    if isinstance(accepted, float) or isinstance(value, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == accepted
    return value == accepted and type(value) is type(accepted)


def trl_flags_reference(flags, title):
    """docs/flags.md's section on the TRL flags a script reads without fields of its own."""
    lines = [f"## {title}", "", "TRL's `GRPOConfig` flags that have no flag of their own here. Each runs as in TRL "
             "with the values in the second column (or hands its value to the flag named there); any other value is "
             "refused with the reason.", "", "| flag | runs here | otherwise |", "|---|---|---|"]
    for name, rule in flags.items():
        if rule.field:
            runs = f"any value: sets `--{rule.field}`"
        elif rule.any_value:
            runs = "any value (no effect here)"
        else:
            runs = ", ".join(f"`{json.dumps(v)}`" for v in rule.accepts)
        lines.append(f"| `--{name}` | {runs} | {rule.reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ---- what utils.core.config calls: the flags of a config's TRL_FLAGS table (a class attribute) ----


def foreign_flags(config_cls) -> dict:
    """The rules of `config_cls.TRL_FLAGS` (name -> TRLFlag) for the names the config does not declare itself."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {k: v for k, v in getattr(config_cls, "TRL_FLAGS", {}).items() if k not in names}


def add_foreign_flags(parser, config_cls):
    flags = foreign_flags(config_cls)
    if flags:
        group = parser.add_argument_group("TRL's flags without one of ours (each runs as in TRL, or is refused)")
        for name, rule in flags.items():
            group.add_argument(f"--{name}", dest=name, nargs="*", metavar="VALUE", help=rule.reason.replace("%", "%%"))


def take_foreign(config_cls, specs, given, where, convert, error):
    """Pop the foreign flags out of `given` (a parsed command line or a recipe's keys, values as typed) and return the
    values of our fields they set (`convert`ed as utils.core.config converts a flag); a value that cannot run is
    refused naming the flag (or key), as `error`."""
    values = {}
    for name in [n for n in given if n in foreign_flags(config_cls)]:
        label = f"{where} --{name}" if where == "argument" else f"{where} {name!r}"
        values.update(_foreign_values(specs, name, given.pop(name), label, given, convert, error))
    return values


def _foreign_values(specs, name, raw, where, given, convert, error):
    """{our field: converted value} that the foreign flag `name` sets ({} when it changes nothing), or its one-line
    refusal. `given` (the command line's other flags, as typed) loses a `--field none` the flag sets (TRL's unset)
    and must not set the field to another value."""
    taken = {field: convert(specs[field], value, where)
             for field, value in trl_flag_values(name, raw, error).items()}
    for field in taken:
        typed = given.get(field)
        typed = typed[0] if isinstance(typed, list) and len(typed) == 1 else typed
        if isinstance(typed, str) and typed.strip().lower() in _NONE:
            given.pop(field)
        elif field in given and convert(specs[field], given[field], f"argument --{field}") != taken[field]:
            raise error(f"{where} sets --{field}, which the command line also sets to another value")
    return taken


def foreign_reference(config_cls, title):
    """docs/flags.md's section on the config's foreign flags ([] when it has none)."""
    flags = foreign_flags(config_cls)
    return [trl_flags_reference(flags, f"{title}: TRL's other flags")] if flags else []


def comma_list(value):
    """A JSON or Python list literal (a TRL list written out, e.g. report_to's []) as our comma-separated string
    ("none" when empty); any other value as it is."""
    if not (isinstance(value, str) and value.strip().startswith("[")):
        return value
    for parse in (json.loads, ast.literal_eval):
        try:
            items = parse(value)
        except (ValueError, SyntaxError):
            continue
        return (",".join(map(str, items)) or "none") if isinstance(items, list) else value
    return value
