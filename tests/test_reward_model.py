"""Text reward models by name (rewards/reward_model.py): a tiny AutoModelForSequenceClassification checkpoint built
here and saved to a folder, scored as TRL scores it (chat template over prompt + completion, right padding, the logit
at the last real token), batched, without gradients, on the device asked for; and `train_grpo.py --reward_funcs
<folder>` training on it."""

import pytest
import torch

import train_grpo
from rewards import get_reward
from rewards.reward_model import TextRewardModel, is_reward_model_name
from tests.launch_helpers import fresh_accelerate_state
from tiny.models import make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from tiny.tokenizer import make_tiny_tokenizer
from utils.core.prompts import build_messages
from utils.core.reward_calls import as_conversation, call_rewards, check_reward_call
from utils.core.tracking import read_jsonl


def make_tiny_reward_model(path, *, pad=True):
    """A 2-layer Qwen2 sequence classifier with one label and the tiny tokenizer's ChatML template."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = make_tiny_tokenizer("qwen2")
    if not pad:
        tok.pad_token = None
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tok.pad_token_id if pad else None, eos_token_id=tok.eos_token_id)
    model = Qwen2ForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores far enough apart to tell completions apart
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


def prompts_and_completions():
    rows = make_shapes_vqa(3, seed=1)
    prompts = [build_messages(r["question"], num_images=1) for r in rows]  # image parts: the text model drops them
    texts = ["The answer is 3.", "Two red circles and a long explanation of them", "x"]
    return prompts, as_conversation(texts), texts


def test_scores_are_trls_last_token_logit_of_the_templated_conversation(reward_model):
    fn = get_reward(reward_model, device="cpu", batch_size=2)
    assert isinstance(fn, TextRewardModel) and fn.__name__ == reward_model
    prompts, completions, texts = prompts_and_completions()
    scores = fn(prompts=prompts, completions=completions, answer=["3"] * 3)
    assert len(scores) == 3 and len(set(scores)) == 3
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    for prompt, text, score in zip(prompts, texts, scores):
        turns = [{"role": m["role"], "content": "".join(p.get("text", "") for p in m["content"])
                  if isinstance(m["content"], list) else m["content"]} for m in prompt]
        rendered = tok.apply_chat_template(turns + [{"role": "assistant", "content": text}], tokenize=False)
        assert text in rendered and "<|im_start|>assistant" in rendered
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]  # alone: no padding at all
        with torch.no_grad():
            want = model(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(want, abs=1e-5)  # right padding in a batch changes nothing
    assert fn.texts(["Q: 2+2? "], ["4"]) == ["Q: 2+2? 4"]  # plain-text prompts: prompt + completion


def test_batched_without_gradients_and_the_same_at_every_batch_size(reward_model, monkeypatch):
    prompts, completions, _ = prompts_and_completions()
    one = TextRewardModel(reward_model, device="cpu", batch_size=1)
    calls = []
    one.model.register_forward_hook(lambda m, args, kwargs, out: calls.append(
        (kwargs["input_ids"].shape[0], torch.is_grad_enabled())), with_kwargs=True)
    all_at_once = TextRewardModel(reward_model, device="cpu", batch_size=8)
    with torch.enable_grad():
        a = one(prompts=prompts, completions=completions)
        b = all_at_once(prompts=prompts, completions=completions)
    assert calls == [(1, False)] * 3  # one forward per batch, no autograd graph
    assert a == pytest.approx(b, abs=1e-5)
    assert not any(p.requires_grad for p in one.model.parameters())
    batches = []
    two = TextRewardModel(reward_model, device="cpu", batch_size=2)
    two.model.register_forward_hook(lambda m, args, kwargs, out: batches.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    two(prompts=prompts, completions=completions)
    assert batches == [2, 1]


def test_device_dtype_pad_and_label_rules(reward_model, tmp_path):
    fn = get_reward(reward_model, device="auto", dtype="bfloat16")
    assert fn.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert next(fn.model.parameters()).dtype == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:1': this machine has no CUDA GPU"):
            get_reward(reward_model, device="cuda:1")
    with pytest.raises(ValueError, match="has no option"):
        get_reward(reward_model, devise="cpu")
    with pytest.raises(ValueError, match="batch_size 0 must be >= 1"):
        get_reward(reward_model, batch_size=0)
    no_pad = TextRewardModel(make_tiny_reward_model(tmp_path / "nopad", pad=False), device="cpu")
    assert no_pad.tokenizer.pad_token_id == no_pad.tokenizer.eos_token_id == no_pad.model.config.pad_token_id
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(reward_model)
    config.num_labels = 2
    config.save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="classifier with 2 labels"):
        get_reward(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="cannot be loaded"):
        get_reward("nobody/no-such-reward-model")  # offline in tests: a hub id that is not there
    assert is_reward_model_name(reward_model) and is_reward_model_name("owner/name")
    assert not is_reward_model_name("cpr") and not is_reward_model_name(str(tmp_path))  # a folder without config


def test_the_trainers_call_passes_the_signature_check(reward_model):
    fn = get_reward(reward_model, device="cpu")
    check_reward_call(fn, reward_model, ["question", "answer", "image"])
    prompts, completions, _ = prompts_and_completions()
    rewards = call_rewards([fn], [reward_model], prompts=prompts, completions=completions,
                           completion_ids=[[1]] * 3, columns={"answer": ["3"] * 3})
    assert rewards.shape == (3, 1) and not rewards.isnan().any()


@pytest.mark.slow
def test_train_grpo_takes_a_reward_model_folder(reward_model, tmp_path):
    data = str(tmp_path / "shapes")
    make_shapes_vqa(16, seed=0, kinds=("count",)).save_to_disk(data)
    cfg = train_grpo.GRPOConfig(
        model_name_or_path=make_tiny_vlm(str(tmp_path / "vlm"), seed=0), dataset_name=data,
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=1, report_to="none", reward_funcs=[reward_model, "format"],
        reward_kwargs={reward_model: {"device": "cpu", "batch_size": 3}}, eval_before=False)
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    (m,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert m[f"rewards/{reward_model}"] == m[f"rewards/{reward_model}"] and m["reward_std"] > 0
