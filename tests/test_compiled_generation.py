"""--cache_implementation static (utils/core/compiled_generation.py): the compiled rollout samples the eager rollout's
tokens (text prompts, and images with a shared prefill), sees each optimizer step, and is refused where it cannot
run. The fast tier compiles with backend aot_eager (seconds); inductor, whose kernels may round a logit
differently, is the full tier's (its compile takes tens of seconds on a CPU)."""

import pytest
import torch

from tiny.shapes import make_shapes_vqa
from utils.core.compiled_generation import CompiledRollout, cache_bucket, resolve_cache_implementation
from utils.core.config import ConfigError
from utils.core.encoding import encode_prompts
from utils.core.logprobs import expand_prompts
from utils.core.prompts import build_messages
from utils.core.rollout import generate_completions
from utils.core.seeds import completion_seeds


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3"])
def setup(request, family_models):
    """A tiny model, three prompts of different lengths (left padding; images for Qwen2.5-VL) and the arguments of
    a rollout of two completions per prompt."""
    model, processor = family_models(request.param)
    rows = make_shapes_vqa(3, seed=5)
    images = [[r["image"]] if request.param == "qwen2_5_vl" else [] for r in rows]
    messages = [build_messages(r["question"] + " Look closely." * i, num_images=len(im))
                for i, (r, im) in enumerate(zip(rows, images))]
    prompts = encode_prompts(processor, messages, images, sample_ids=["a", "b", "c"])
    tok = getattr(processor, "tokenizer", processor)
    # a third of the vocabulary suppressed: a decode loop that skipped generate's processors would sample them
    suppress = [i for i in range(0, len(tok), 3) if i not in (tok.eos_token_id, tok.pad_token_id)]
    kwargs = dict(row_seeds=completion_seeds(0, 0, range(6)), max_new_tokens=12, temperature=1.0,
                  eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id, suppress_token_ids=suppress)
    return model, prompts, torch.tensor([0, 0, 1, 1, 2, 2]), kwargs


@pytest.mark.parametrize("shared", [True, pytest.param(False, marks=[pytest.mark.slow, pytest.mark.full])])
def test_compiled_rollout_samples_the_eager_tokens(setup, shared):
    """Same completions as generate_completions, with each prompt prefilled once (train_grpo's rollout) or per
    completion; a second call reuses the compiled step and its cache."""
    model, prompts, index, kwargs = setup
    batch, prompt_index = (prompts, index) if shared else (expand_prompts(prompts, index), None)
    eager = generate_completions(model, batch, prompt_index=prompt_index, **kwargs)
    rollout = CompiledRollout(backend="aot_eager")
    for _ in range(2):
        compiled = rollout.generate(model, batch, prompt_index=prompt_index, **kwargs)
        assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    assert rollout.compiles == 1 and eager[0].shape[1] > 1


@pytest.mark.parametrize("setup", ["qwen3"], indirect=True)
def test_compiled_step_sees_each_optimizer_step(setup):
    """After an in-place optimizer step, the compiled decode step's logits are the updated model's (its eager
    forward over prompt + completion), not the old ones."""
    model, prompts, index, kwargs = setup
    batch = expand_prompts(prompts, index)
    rollout = CompiledRollout(backend="aot_eager")
    rollout.generate(model, batch, **kwargs)  # compiles
    recorded = []
    step = rollout._step
    rollout._step = lambda *args: recorded.append(step(*args)) or recorded[-1]
    params = [p for p in model.parameters() if p.requires_grad]
    before = {id(p): p.detach().clone() for p in params}
    optimizer = torch.optim.SGD(params, lr=0.5)
    model.train()
    logits = model(**batch).logits[:, -1]
    (logits.float().logsumexp(-1) - logits[:, 0]).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    try:
        ids, _ = rollout.generate(model, batch, **kwargs)
        t = 3  # the logits that chose completion token t (decode step t)
        full = dict(batch, input_ids=torch.cat([batch["input_ids"], ids[:, :t]], 1),
                    attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(ids[:, :t])], 1))
        if "mm_token_type_ids" in batch:
            full["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(ids[:, :t])], 1)
        with torch.no_grad():
            updated = model(**full).logits[:, -1].float()
        assert (updated - recorded[t - 1]).abs().max() < 1e-4
        with torch.no_grad():  # the old weights give other logits: the step above changed what the rollout saw
            for p in params:
                p.copy_(before[id(p)])
            old = model(**full).logits[:, -1].float()
        assert (old - recorded[t - 1]).abs().max() > 1e-2
    finally:
        rollout._step = step
        with torch.no_grad():
            for p in params:
                p.copy_(before[id(p)])


@pytest.mark.parametrize("setup", ["qwen3"], indirect=True)
def test_cache_implementation_is_resolved_and_refused_by_name(setup):
    model = setup[0]
    assert resolve_cache_implementation("auto", model, device="cpu") is False  # CPU: eager unless asked
    assert resolve_cache_implementation("static", model, device="cpu") is True
    assert resolve_cache_implementation("auto", model, device="cuda") is True  # CUDA: compiled where it can run
    assert resolve_cache_implementation("dynamic", model, device="cuda") is False
    notes = []
    assert resolve_cache_implementation("auto", model, device="cuda", use_vllm=True, notice=notes.append) is False
    assert resolve_cache_implementation("auto", model, device="cuda", zero3=True, notice=notes.append) is False
    assert len(notes) == 1 and "ZeRO-3" in notes[0] and notes[0].startswith("--cache_implementation auto")
    with pytest.raises(ConfigError, match=r"--cache_implementation static: ZeRO-3 \(and FSDP2\) gather the sharded"):
        resolve_cache_implementation("static", model, device="cuda", zero3=True)
    with pytest.raises(ConfigError, match="--cache_implementation static: --use_vllm"):
        resolve_cache_implementation("static", model, device="cuda", use_vllm=True)
    with pytest.raises(ConfigError, match="--cache_implementation 'paged' is not one of"):
        resolve_cache_implementation("paged", model, device="cpu")


def test_models_with_sliding_window_layers_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    model = Qwen2ForCausalLM(config)
    with pytest.raises(ConfigError, match="--cache_implementation static: Qwen2ForCausalLM has sliding_attention"):
        resolve_cache_implementation("static", model, device="cpu")


def test_cache_buckets_are_powers_of_two():
    assert [cache_bucket(n) for n in (1, 64, 65, 128, 600)] == [64, 64, 128, 128, 1024]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("family", ["internvl", "glm4v", "qwen3_vl"])
def test_other_families_sample_the_eager_tokens(family_models, family):
    """InternVL (plain positions, prompts not shared), GLM-4.1V and Qwen3-VL (3-D rope, shared prefill)."""
    from utils.core.logprobs import can_share_prompts

    model, processor = family_models(family)
    rows = make_shapes_vqa(2, seed=5)
    messages = [build_messages(r["question"] + " Look." * i, num_images=1) for i, r in enumerate(rows)]
    prompts = encode_prompts(processor, messages, [[r["image"]] for r in rows], sample_ids=["a", "b"])
    tok = getattr(processor, "tokenizer", processor)
    index = torch.tensor([0, 0, 1, 1])
    batch, prompt_index = (prompts, index) if can_share_prompts(model, [1, 1]) else (expand_prompts(prompts, index),
                                                                                      None)
    kwargs = dict(row_seeds=completion_seeds(0, 0, range(4)), max_new_tokens=10, temperature=1.0,
                  eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id, prompt_index=prompt_index)
    eager = generate_completions(model, batch, **kwargs)
    compiled = CompiledRollout(backend="aot_eager").generate(model, batch, **kwargs)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("setup", ["qwen2_5_vl"], indirect=True)
def test_inductor_rollout_tokens_against_eager(setup):
    """The inductor-compiled step's kernels may round a logit differently from eager, which could change a draw
    near a tie; on the tiny models none has (docs/results/2026-12-03-compiled-rollout.md), here with images and
    a shared prefill."""
    model, prompts, index, kwargs = setup
    batch, kwargs = prompts, dict(kwargs, max_new_tokens=24, prompt_index=index)
    eager = generate_completions(model, batch, **kwargs)
    compiled = CompiledRollout().generate(model, batch, **kwargs)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


def test_static_with_vllm_fails_in_validate():
    from train_grpo import GRPOConfig, validate

    with pytest.raises(ConfigError, match="--cache_implementation static compiles the HF rollout, and --use_vllm"):
        validate(GRPOConfig(use_vllm=True, cache_implementation="static"), 1)
    with pytest.raises(ConfigError, match="--cache_implementation 'paged'"):
        validate(GRPOConfig(cache_implementation="paged"), 1)


@pytest.mark.slow
@pytest.mark.full
def test_train_grpo_with_a_compiled_rollout_logs_the_eager_runs_metrics(tmp_path, monkeypatch):
    """train_grpo.py --cache_implementation static against dynamic, 2 steps with a weight update in between: the
    same rewards, losses and gradient norms, and the compiled rollout really ran (one compile, reused)."""
    import json

    import train_grpo
    from tests.launch_helpers import fresh_accelerate_state
    from tiny.models import make_tiny_vlm

    make_shapes_vqa(24, seed=0, kinds=("color", "count")).save_to_disk(str(tmp_path / "data"))
    model = make_tiny_vlm(str(tmp_path / "qwen"), seed=0)
    built = []
    monkeypatch.setattr(train_grpo, "CompiledRollout", lambda: built.append(CompiledRollout("aot_eager")) or built[-1])
    metrics = {}
    for impl in ("dynamic", "static"):
        out = tmp_path / impl
        cfg = train_grpo.GRPOConfig(
            model_name_or_path=model, dataset_name=str(tmp_path / "data"), output_dir=str(out),
            per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
            learning_rate=1e-3, report_to="none", seed=0, reward_funcs=["tests.grpo_helpers:completion_length"],
            cache_implementation=impl)
        try:
            train_grpo.main(cfg)
        finally:
            fresh_accelerate_state()
        metrics[impl] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(built) == 1 and built[0].compiles == 1
    keys = ("reward", "loss", "completion_length", "grad_norm")
    assert [[m[k] for k in keys] for m in metrics["static"]] == [[m[k] for k in keys] for m in metrics["dynamic"]]
    assert len(metrics["static"]) == 2


@pytest.mark.slow
@pytest.mark.full
def test_compiled_rollout_under_lora(tmp_path):
    """A PeftModel (train_grpo's --use_peft): generate goes through peft, the compiled step through the LoRA
    layers of the base model; the same tokens as eager, with adapters that change the outputs."""
    from types import SimpleNamespace

    from tests.family_helpers import build_family
    from utils.core.models import adapters_disabled, prepare_for_training

    model, processor = build_family(str(tmp_path / "qwen"), "qwen2_5_vl")
    lora = SimpleNamespace(gradient_checkpointing=False, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                           lora_target_modules=["all-linear"])
    model = prepare_for_training(model, lora).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    rows = make_shapes_vqa(2, seed=5)
    messages = [build_messages(r["question"], num_images=1) for r in rows]
    prompts = encode_prompts(processor, messages, [[r["image"]] for r in rows], sample_ids=["a", "b"])
    tok = processor.tokenizer
    kwargs = dict(row_seeds=completion_seeds(0, 0, range(4)), max_new_tokens=10, temperature=1.0,
                  eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                  prompt_index=torch.tensor([0, 0, 1, 1]))
    eager = generate_completions(model, prompts, **kwargs)
    compiled = CompiledRollout(backend="aot_eager").generate(model, prompts, **kwargs)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    with adapters_disabled(model):
        assert not torch.equal(generate_completions(model, prompts, **kwargs)[0], eager[0])
