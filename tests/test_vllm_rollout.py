"""utils/core/vllm_rollout.py without vLLM: what the engine is given (environment, engine and sampling arguments,
prompt ids, pixel budget, stop and suppressed tokens) against the HF path, how its outputs are masked, the
sampler/trainer mismatch metrics and importance weights, and the weight sync (order, gathering, LoRA merged
layer by layer), with a fake vLLM module standing in for the engine. The real engine runs in
bench/gpu_check.sh (bench/vllm_smoke.py)."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from safetensors import safe_open
from transformers import SuppressTokensLogitsProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from tests.vllm_helpers import DIST_KEYS, FakeVLLM, request_output
from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.core.encoding import encode_prompts
from utils.core.importance import importance_weights, mismatch_metrics, mismatch_stats
from utils.core.logprobs import CompletionLogProbs
from utils.core.models import load_model_and_processor
from utils.core.prompts import build_messages
from utils.core.rollout import completion_mask, special_token_ids_to_suppress, stop_token_ids
from utils.core.vllm_flags import FLAG_DEFAULTS
from utils.core.vllm_rollout import (
    VLLMRollout,
    engine_kwargs,
    mm_processor_kwargs,
    prompt_token_ids,
    sampling_kwargs,
    set_distributed_env,
    unpack_outputs,
    vllm_prompts,
)
from utils.core.vllm_weights import iter_sync_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return {"vlm": make_tiny_vlm(str(root / "vlm"), seed=0), "llm": make_tiny_llm(str(root / "llm"), seed=0)}


@pytest.fixture
def clean_env(monkeypatch):
    for key in DIST_KEYS:  # set, then delete: monkeypatch undoes whatever the test writes
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)


def cfg(**over):
    base = dict(seed=3, temperature=0.9, top_p=1.0, top_k=None, max_completion_length=6, max_prompt_length=512,
                bf16=False, dtype="auto", max_pixels=None, min_pixels=None, max_anyres_num=None)
    return SimpleNamespace(**{**base, **over})


def vqa(n, with_images=True):
    rows = make_shapes_vqa(n, seed=7)
    images = [[r["image"]] if with_images else [] for r in rows]
    messages = [build_messages(r["question"], num_images=len(im)) for r, im in zip(rows, images)]
    return messages, images


# ----------------------------------------------------------------------------------------------
# environment and engine arguments
# ----------------------------------------------------------------------------------------------


def test_distributed_env_is_set_like_trl(clean_env):
    env = set_distributed_env(0, 0, 1)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}
    assert 0 < int(env["MASTER_PORT"]) < 65536 and os.environ["MASTER_PORT"] == env["MASTER_PORT"]


def test_distributed_env_keeps_the_launchers_rendezvous():
    env = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29511"}
    assert set_distributed_env(3, 1, 8, env) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                                                  "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29511"}
    env = {"MASTER_PORT": "auto"}
    assert set_distributed_env(0, 0, 1, env)["MASTER_PORT"] not in ("auto", "0", "")


def test_engine_arguments_from_flags_and_defaults():
    text = engine_kwargs("/m", cfg(), vision_language=False, seed=5, mm_kwargs={"size": {}})
    assert text["distributed_executor_backend"] == "external_launcher" and text["tensor_parallel_size"] == 1
    assert text["logprobs_mode"] == "processed_logprobs" and text["seed"] == 5 and text["model"] == "/m"
    assert "limit_mm_per_prompt" not in text and "mm_processor_kwargs" not in text  # vLLM refuses them for LLMs
    assert text["gpu_memory_utilization"] == FLAG_DEFAULTS["vllm_gpu_memory_utilization"]
    assert text["max_num_batched_tokens"] == FLAG_DEFAULTS["vllm_max_num_batched_tokens"]
    assert "max_num_seqs" not in text and text["enable_sleep_mode"] is False
    assert text["max_model_len"] == 512 + 6 and text["dtype"] == "auto"
    flags = cfg(bf16=True, vllm_gpu_memory_utilization=0.55, vllm_max_num_seqs=64, vllm_max_num_batched_tokens=8192,
                vllm_enable_sleep_mode=True, vllm_max_model_len=1024)
    vlm = engine_kwargs("/m", flags, vision_language=True, seed=0, mm_kwargs={"max_pixels": 3136},
                        max_images_per_prompt=2)
    assert vlm["limit_mm_per_prompt"] == {"image": 2} and vlm["mm_processor_kwargs"] == {"max_pixels": 3136}
    assert (vlm["gpu_memory_utilization"], vlm["max_num_seqs"], vlm["max_num_batched_tokens"]) == (0.55, 64, 8192)
    assert vlm["enable_sleep_mode"] is True and vlm["max_model_len"] == 1024 and vlm["dtype"] == "bfloat16"
    assert "max_model_len" not in engine_kwargs("/m", cfg(max_prompt_length=None), vision_language=False, seed=0)
    passed = engine_kwargs("/m", cfg(vllm_tensor_parallel_size=2, vllm_model_impl="transformers",
                                     vllm_max_model_length=777), vision_language=False, seed=0)
    assert (passed["tensor_parallel_size"], passed["model_impl"], passed["max_model_len"]) == (2, "transformers", 777)
    assert text["model_impl"] == "vllm"


def test_pixel_budget_reaches_vllm(tiny):
    # vLLM counts a Qwen-VL image's tokens with smart_resize under `size` (its _get_vision_info); with the
    # trainer's budget it must count what the trainer's processor put in the prompt
    model, processor = load_model_and_processor(tiny["vlm"], max_pixels=56 * 56)
    messages, images = vqa(1)
    batch = encode_prompts(processor, messages, images, sample_ids=["a"])
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    in_prompt = int((batch["input_ids"] == image_id).sum())
    ip, vis = processor.image_processor, model.config.vision_config
    factor = vis.patch_size * vis.spatial_merge_size

    def vllm_count(size):
        h, w = smart_resize(images[0][0].height, images[0][0].width, factor=factor,
                            min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return (h // factor) * (w // factor)

    kwargs = mm_processor_kwargs(processor)
    assert kwargs["size"]["longest_edge"] == 56 * 56
    assert vllm_count(kwargs["size"]) == in_prompt == 4
    _, default = load_model_and_processor(tiny["vlm"])
    assert vllm_count(dict(default.image_processor.size)) != in_prompt  # vLLM's own default would disagree
    assert ip.size["longest_edge"] == 56 * 56
    assert mm_processor_kwargs(None, cfg(max_pixels=3136, min_pixels=784)) == {"min_pixels": 784, "max_pixels": 3136}
    assert mm_processor_kwargs(processor.tokenizer) == {}  # a text model's tokenizer has no image budget


# ----------------------------------------------------------------------------------------------
# sampling: stop ids, suppressed tokens, seeds
# ----------------------------------------------------------------------------------------------


def test_sampling_matches_the_hf_path(tiny):
    model, processor = load_model_and_processor(tiny["vlm"])
    tok = processor.tokenizer
    stop = stop_token_ids(model, tok)
    suppress = special_token_ids_to_suppress(tok, stop)
    kw = sampling_kwargs(cfg(top_k=5, top_p=0.8), seed=-(2**40) - 3, stop_ids=stop, suppress_ids=suppress)
    assert kw["stop_token_ids"] == stop and kw["temperature"] == 0.9 and (kw["top_k"], kw["top_p"]) == (5, 0.8)
    assert kw["max_tokens"] == 6 and kw["logprobs"] == 0 and kw["n"] == 1 and 0 <= kw["seed"] < 2**31
    assert tok.convert_tokens_to_ids("<|image_pad|>") in kw["logit_bias"]
    assert not set(stop) & set(kw["logit_bias"])  # EOS stays sampleable
    # vLLM adds logit_bias to the logits; HF's suppress_tokens processor sets them to -inf: the same scores
    scores = torch.randn(3, len(tok), generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(len(tok))
    bias[list(kw["logit_bias"])] = torch.tensor(list(kw["logit_bias"].values()))
    hf = SuppressTokensLogitsProcessor(suppress)(torch.zeros(3, 1, dtype=torch.long), scores.clone())
    assert torch.equal(torch.softmax(scores + bias, -1), torch.softmax(hf, -1))
    assert sampling_kwargs(cfg(), seed=1, stop_ids=stop, suppress_ids=[])["top_k"] == 0  # top_k None: off


def test_prompt_ids_are_the_trainers_own(tiny):
    _, processor = load_model_and_processor(tiny["vlm"])
    messages, images = vqa(2)
    messages[1] = build_messages("A much longer question? " * 3, num_images=1)
    batch = encode_prompts(processor, messages, images, sample_ids=["a", "b"])  # left padded
    rows = prompt_token_ids(batch)
    for i in range(2):
        alone = encode_prompts(processor, messages[i:i + 1], images[i:i + 1], sample_ids=["x"])["input_ids"][0]
        assert rows[i] == alone.tolist()
    assert prompt_token_ids(batch, torch.tensor([1, 1, 0])) == [rows[1], rows[1], rows[0]]
    prompts = vllm_prompts(rows, images)
    assert prompts[0]["prompt_token_ids"] == rows[0] and prompts[0]["multi_modal_data"]["image"] is images[0][0]
    two = vllm_prompts([rows[0]], [[images[0][0], images[1][0]]])[0]["multi_modal_data"]["image"]
    assert isinstance(two, list) and len(two) == 2
    assert "multi_modal_data" not in vllm_prompts([[1, 2]], [[]])[0]


# ----------------------------------------------------------------------------------------------
# outputs: ids, masks, log-probs
# ----------------------------------------------------------------------------------------------


def test_outputs_are_masked_like_the_hf_path():
    eos, pad = [9, 7], 0
    rows = [[5, 6, 9], [5, 6, 5, 6], [7]]  # stopped; hit max_tokens; stopped at the other stop id
    outs = [request_output([1, 2], r, [-0.1 * (t + 1) for t in range(len(r))], missing=(1,) if i == 1 else ())
            for i, r in enumerate(rows)]
    ids, mask, logps = unpack_outputs(outs, [[1, 2]] * 3, pad_token_id=pad, stop_ids=eos)
    assert ids.tolist() == [[5, 6, 9, 0], [5, 6, 5, 6], [7, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    hf_padded = torch.tensor([[5, 6, 9, 9], [5, 6, 5, 6], [7, 9, 9, 9]])  # the HF path pads after EOS
    assert torch.equal(mask, completion_mask(hf_padded, eos))
    assert math.isnan(logps[1, 1]) and logps[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0.0])
    _, _, none = unpack_outputs([request_output([1], [5])], [[1]], pad_token_id=0, stop_ids=eos)
    assert none is None
    with pytest.raises(RuntimeError, match="prompt 0 into 3 tokens where the trainer has 2"):
        unpack_outputs([request_output([1, 2, 2], [5])], [[1, 2]], pad_token_id=0, stop_ids=eos)


# ----------------------------------------------------------------------------------------------
# importance weights and mismatch metrics
# ----------------------------------------------------------------------------------------------


def test_importance_weights_follow_trls_rule():
    train = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.2, -3.0, 0.0, 0.0]])
    vllm = torch.tensor([[-1.5, -1.0, math.nan, 0.0], [-0.2, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ratio = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 1.0], [1.0, math.exp(-2.0), 1.0, 1.0]])
    assert torch.allclose(importance_weights(train, vllm, mask, mode="token_truncate", cap=1.5), ratio.clamp(max=1.5))
    masked = importance_weights(train, vllm, mask, mode="token_mask", cap=1.5)
    assert torch.allclose(masked, torch.where(ratio > 1.5, 0.0, ratio))
    seq = importance_weights(train, vllm, mask, mode="sequence_truncate", cap=10.0)
    assert seq.shape == (2, 1) and torch.allclose(seq[:, 0], torch.tensor([math.exp(-0.5), math.exp(-2.0)]))
    assert importance_weights(train, vllm, mask, mode="sequence_mask", cap=0.5)[:, 0].tolist() == pytest.approx(
        [0.0, math.exp(-2.0)])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance_weights(train, vllm, mask, mode="token")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(train, vllm, mask, cap=0.0)


def test_importance_weights_correct_the_sampler():
    # tokens drawn from the sampler q; weighted by pi/q they estimate an expectation under pi (the trainer)
    gen = torch.Generator().manual_seed(0)
    pi, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    f = torch.tensor([1.0, 2.0, 4.0])
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=gen)
    w = importance_weights(pi.log()[tokens][None], q.log()[tokens][None], torch.ones(1, len(tokens)), cap=100.0)
    assert (w[0] * f[tokens]).mean().item() == pytest.approx((pi * f).sum().item(), rel=0.01)
    assert f[tokens].mean().item() == pytest.approx((q * f).sum().item(), rel=0.01)  # uncorrected: q's mean


def test_mismatch_metrics_over_scored_tokens_and_ranks():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    vllm = torch.tensor([[-1.5, -1.0, math.nan], [-0.2, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w = importance_weights(train, vllm, mask, cap=2.0)
    stats = mismatch_stats(train, vllm, mask, w)
    metrics = mismatch_metrics(stats, lambda t, op: t)
    assert metrics["vllm/logp_diff_mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 2.0) / 4)  # NaN left out
    assert metrics["vllm/logp_diff_max"] == pytest.approx(2.0)
    assert metrics["vllm/is_weight_max"] == pytest.approx(math.exp(0.5))
    assert metrics["vllm/is_weight_min"] == pytest.approx(math.exp(-2.0))
    # two ranks: sums add and maxima combine to the statistics of the whole batch
    halves = [mismatch_stats(train[i:i + 1], vllm[i:i + 1], mask[i:i + 1], w[i:i + 1]) for i in range(2)]
    for key, value in stats.items():
        combined = torch.stack([h[key] for h in halves])
        assert torch.allclose(combined.max() if key.endswith("max") else combined.sum(), value), key


# ----------------------------------------------------------------------------------------------
# weight sync
# ----------------------------------------------------------------------------------------------


def checkpoint_names(path):
    names = set()
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), "pt") as f:
                names |= set(f.keys())
    return names


class RecordingGather:
    """A stand-in for ZeRO-3's GatheredParameters: records what is gathered while each tensor is handed out."""

    def __init__(self):
        self.live, self.log = set(), []

    def __call__(self, params):
        gather = self

        class Ctx:
            def __enter__(self):
                assert not gather.live, "a gather was opened inside another"
                gather.live = {id(p) for p in params}

            def __exit__(self, *exc):
                gather.live = set()

        return Ctx()


def test_sync_goes_parameter_by_parameter_with_checkpoint_names(tiny):
    model, _ = load_model_and_processor(tiny["llm"])
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen: vLLM has it from the checkpoint
    gather = RecordingGather()
    params = dict(model.named_parameters())
    yielded = []
    for name, tensor in iter_sync_weights(model, gather):
        assert gather.live == {id(params[name])}  # exactly this parameter is gathered while it is handed out
        assert tensor.data_ptr() == params[name].data_ptr()  # no copy
        yielded.append(name)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert yielded == trainable and "model.embed_tokens.weight" not in yielded
    assert set(yielded) <= checkpoint_names(tiny["llm"])


def test_lora_is_merged_layer_by_layer_without_touching_the_policy(tiny):
    from peft import LoraConfig, get_peft_model

    model, _ = load_model_and_processor(tiny["llm"])
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["norm"]))
    torch.manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # non-zero adapters
    base_before = {n: p.detach().clone() for n, p in peft.named_parameters() if "base_layer" in n}
    peft.merge_adapter = peft.unmerge_adapter = None  # the old whole-model merge must not be used
    gather = RecordingGather()
    modules = dict(peft.get_base_model().named_modules())
    synced = {}
    for name, tensor in iter_sync_weights(peft, gather):
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            layer = modules[name.rsplit(".", 1)[0]]
            assert gather.live == {id(p) for p in layer.parameters()}  # this layer only: base + its adapters
        synced[name] = tensor.clone()
    assert all(torch.equal(p, base_before[n]) for n, p in peft.named_parameters() if "base_layer" in n)
    merged = get_peft_model(load_model_and_processor(tiny["llm"])[0], peft.peft_config["default"])
    merged.load_state_dict(peft.state_dict())
    want = dict(merged.merge_and_unload().named_parameters())
    names = checkpoint_names(tiny["llm"])
    saved = {n.replace(".modules_to_save.default.", ".") for n, _ in peft.get_base_model().named_parameters()
             if ".modules_to_save.default." in n}  # every *norm module: trained copies replace the originals
    assert "model.norm.weight" in saved
    assert set(synced) == {n for n in want if ("q_proj" in n or "v_proj" in n) and n.endswith("weight")} | saved
    assert set(synced) <= names
    for name, tensor in synced.items():
        assert torch.allclose(tensor, want[name], atol=1e-6), name


# ----------------------------------------------------------------------------------------------
# the rollout object against a fake engine
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def rollout_setup(tiny, clean_env):
    FakeVLLM.engines.clear()
    accelerator = Accelerator(cpu=True)
    model, processor = load_model_and_processor(tiny["vlm"])
    policy = CompletionLogProbs(model)
    return accelerator, model, processor, policy


def test_rollout_feeds_and_masks_like_the_hf_path(rollout_setup):
    accelerator, model, processor, policy = rollout_setup
    tok = processor.tokenizer
    rollout = VLLMRollout("/tiny", accelerator, cfg(), processor=processor, model_config=model.config, vllm=FakeVLLM)
    llm = FakeVLLM.engines[0]
    assert llm.env["RANK"] == "0" and llm.env["WORLD_SIZE"] == "1" and llm.env["MASTER_PORT"]  # before the engine
    assert llm.kwargs["limit_mm_per_prompt"] == {"image": 4, "video": 0} and "size" in llm.kwargs["mm_processor_kwargs"]
    messages, images = vqa(2)
    stop = stop_token_ids(model, tok)
    batch = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    per_completion = [0, 0, 1, 1]  # a group of two completions per prompt
    ids, mask, logps = rollout.generate(policy, processor, [messages[i] for i in per_completion],
                                        [images[i] for i in per_completion], [11, 12, 13, 14], step=0, stop_ids=stop,
                                        prompt_batch=batch, prompt_index=torch.tensor(per_completion),
                                        return_logprobs=True)
    sent = [p["prompt_token_ids"] for p in llm.prompts]
    assert sent == [prompt_token_ids(batch)[i] for i in (0, 0, 1, 1)]
    assert [p.seed for p in llm.params] == [11, 12, 13, 14]
    assert set(llm.params[0].logit_bias) == set(special_token_ids_to_suppress(tok, stop))  # computed when not given
    lengths = [len(o.outputs[0].token_ids) for o in llm.outputs]  # each ends at its stop id
    assert ids.shape == mask.shape == logps.shape and mask.sum(-1).tolist() == lengths
    assert torch.equal(mask, completion_mask(ids.masked_fill(mask == 0, stop[0]), stop))  # the HF path's mask
    assert logps[mask.bool()].eq(-0.5).all() and logps[~mask.bool()].eq(0).all()
    # compatibility with the older call (messages only): the same prompt ids, encoded by encode_prompts
    ids2, mask2 = rollout.generate(policy, processor, messages, images, [11, 13], step=0, stop_ids=stop)
    assert [p["prompt_token_ids"] for p in llm.prompts] == prompt_token_ids(batch)
    assert torch.equal(ids2, ids[[0, 2]]) and torch.equal(mask2, mask[[0, 2]])
    with pytest.raises(ValueError, match="2 prompts, 2 image lists and 1 seeds"):
        rollout.generate(policy, processor, messages, images, [1], step=0, stop_ids=stop)
    with pytest.raises(ValueError, match="prompt 0 has 5 images"):
        rollout.generate(policy, processor, messages[:1], [images[0] * 5], [1], step=0, stop_ids=stop)


def test_rollout_syncs_once_per_step_and_sleeps_between_rounds(rollout_setup):
    accelerator, model, processor, policy = rollout_setup
    model.get_input_embeddings().weight.requires_grad_(False)
    rollout = VLLMRollout("/tiny", accelerator, cfg(vllm_enable_sleep_mode=True), processor=processor,
                          model_config=model.config, vllm=FakeVLLM)
    llm = FakeVLLM.engines[0]
    assert llm.calls == [("sleep", 2)]  # the memory is training's until the first round
    messages, images = vqa(1)
    stop = stop_token_ids(model, processor.tokenizer)
    for step in (0, 0, 1):
        rollout.generate(policy, processor, messages, images, [1], step=step, stop_ids=stop)
        if step == 1:
            rollout.sleep()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert llm.model.loaded == trainable * 2  # steps 0 and 1, one parameter per load call, frozen ones never
    names = [c[0] for c in llm.calls]
    assert names == ["sleep", "wake_up", "reset_prefix_cache", "wake_up", "generate", "generate",
                     "reset_prefix_cache", "generate", "sleep"]
    assert llm.calls[1] == ("wake_up", ("weights",)) and llm.calls[3] == ("wake_up", ("kv_cache",))
    rollout.generate(policy, processor, messages, images, [1], step=1, stop_ids=stop)  # weights were dropped
    assert llm.model.loaded == trainable * 3 and llm.calls[-4:-1] == [
        ("wake_up", ("weights",)), ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]


def test_text_model_engine_has_no_image_arguments(tiny, clean_env):
    FakeVLLM.engines.clear()
    model, tok = load_model_and_processor(tiny["llm"])
    VLLMRollout("/tiny", Accelerator(cpu=True), cfg(), processor=tok, model_config=model.config, vllm=FakeVLLM)
    kwargs = FakeVLLM.engines[0].kwargs
    assert "limit_mm_per_prompt" not in kwargs and "mm_processor_kwargs" not in kwargs


def test_bad_importance_flags_fail_before_the_engine(tiny, clean_env):
    FakeVLLM.engines.clear()
    model, tok = load_model_and_processor(tiny["llm"])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        VLLMRollout("/tiny", Accelerator(cpu=True), cfg(vllm_importance_sampling_mode="per_token"), processor=tok,
                    model_config=model.config, vllm=FakeVLLM)
    assert FakeVLLM.engines == []


# ----------------------------------------------------------------------------------------------
# LoRA as a vLLM adapter (--vllm_lora_sync)
# ----------------------------------------------------------------------------------------------


def lora_flags(**over):
    return cfg(**{**dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["all-linear"],
                         gradient_checkpointing=False), **over})


def test_lora_rank_and_mode_rules():
    from utils.core.vllm_flags import lora_sync_mode
    from utils.core.vllm_weights import vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 4, 16, 17, 320, 512, 513)] == [1, 8, 16, 32, 320, 512, None]
    assert lora_sync_mode(cfg()) is None and lora_sync_mode(cfg(use_peft=False)) is None
    assert lora_sync_mode(lora_flags()) == "adapter"  # auto, colocated
    assert lora_sync_mode(lora_flags(vllm_mode="server")) == "merge"  # a server takes weights only
    assert lora_sync_mode(lora_flags(lora_r=1024)) == "merge"  # over vLLM's largest rank
    assert lora_sync_mode(lora_flags(vllm_lora_sync="merge")) == "merge"
    kwargs = engine_kwargs("/m", cfg(), vision_language=False, seed=0, lora_rank=24)
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 1, 32)
    assert "enable_lora" not in engine_kwargs("/m", cfg(), vision_language=False, seed=0)


@pytest.mark.parametrize("rslora", [False, True])
def test_lora_adapter_goes_as_a_lora_request_with_new_ids_and_vllms_scaling(rollout_setup, rslora):
    from utils.core.models import prepare_for_training
    from utils.core.vllm_weights import vllm_lora_scaling

    accelerator, model, processor, _ = rollout_setup
    flags = lora_flags(lora_r=4 if not rslora else 16, lora_alpha=8)
    peft = prepare_for_training(model, flags)
    if rslora:  # PEFT's rank-stabilised scale alpha / sqrt(r): vLLM reads use_rslora from adapter_config.json
        for layer in [m for m in peft.modules() if hasattr(m, "scaling") and isinstance(m.scaling, dict)]:
            layer.scaling["default"] = 8 / math.sqrt(16)
        peft.peft_config["default"].use_rslora = True
    torch.manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    policy = CompletionLogProbs(peft)
    rollout = VLLMRollout("/tiny", accelerator, flags, processor=processor, model_config=model.config, vllm=FakeVLLM)
    llm = FakeVLLM.engines[0]
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_loras"], llm.kwargs["max_lora_rank"]) == (True, 1, 8 if not
                                                                                                   rslora else 16)
    messages, images = vqa(1)
    stop = stop_token_ids(model, processor.tokenizer)
    for step in (0, 0, 1):
        rollout.generate(policy, processor, messages, images, [1], step=step, stop_ids=stop)
    assert llm.lora_ids == [1, 1, 2]  # a new id per sync, so vLLM loads the new adapter; the same within a step
    assert ("remove_lora", 1) in llm.calls and not os.path.exists(os.path.join(rollout.lora_dir, "adapter-1"))
    name, config, tensors = llm.adapters[2]
    assert name == "policy-2" and config["r"] == (4 if not rslora else 16) and config["lora_alpha"] == 8
    assert bool(config.get("use_rslora")) == rslora and config["peft_type"] == "LORA"
    # the adapter covers the language model's layers; the vision tower's LoRA layers arrive merged as weights
    adapted = {k[len("base_model.model."):-len(".lora_A.weight")] for k in tensors if k.endswith("lora_A.weight")}
    assert adapted and not any(".visual." in n or n.startswith("model.visual") for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(config["target_modules"])
    loaded = set(llm.model.loaded)
    assert not any(f"{n}.weight" in loaded for n in adapted)  # no merged copy of the adapted layers
    assert loaded and all("visual" in n for n in loaded)  # only the tower's merged layers (nothing else trains)
    # what vLLM computes from the adapter (base + scale * B A) is the policy's merged weight, layer by layer
    merged = dict(iter_sync_weights(peft))
    base = {n: p for n, p in peft.get_base_model().named_parameters()}
    for layer in sorted(adapted)[:6]:
        a = tensors[f"base_model.model.{layer}.lora_A.weight"]
        b = tensors[f"base_model.model.{layer}.lora_B.weight"]
        want = merged[f"{layer}.weight"]
        got = base[f"{layer}.base_layer.weight"] + vllm_lora_scaling(config) * (b @ a)
        assert torch.allclose(got, want, atol=1e-6), layer


def test_lora_sync_merge_keeps_the_old_path(rollout_setup):
    from utils.core.models import prepare_for_training

    accelerator, model, processor, _ = rollout_setup
    flags = lora_flags(vllm_lora_sync="merge")
    peft = prepare_for_training(model, flags)
    rollout = VLLMRollout("/tiny", accelerator, flags, processor=processor, model_config=model.config, vllm=FakeVLLM)
    llm = FakeVLLM.engines[0]
    messages, images = vqa(1)
    rollout.generate(CompletionLogProbs(peft), processor, messages, images, [1], step=0,
                     stop_ids=stop_token_ids(model, processor.tokenizer))
    assert "enable_lora" not in llm.kwargs and llm.lora_ids == [None] and not llm.adapters
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in llm.model.loaded  # merged into the base
