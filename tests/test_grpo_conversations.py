"""TRL's conversational VLM prompts through GRPO: a system turn, images inside later turns, a few-shot assistant turn.
The log-prob passes (shared prompt, packed, padded) equal a plain forward on Qwen2.5-VL, Qwen3-VL, Gemma 3 and
InternVL (a family without the shared pass); train_grpo.py trains on such a data set unchanged, its other columns
reaching the rewards as TRL passes them; the TRL example of docs/data.md runs as written."""

import json
import os
import re

import pytest
import torch
from PIL import Image

import train_grpo
from tests.family_helpers import completions, plain_logprobs
from tests.launch_helpers import fresh_accelerate_state
from train_grpo import GRPOConfig
from utils.core.conversations import load_prompt_set, prompt_images, prompt_messages
from utils.core.encoding import encode_prompts
from utils.core.logprobs import CompletionLogProbs, can_share_prompts
from utils.core.tracking import read_jsonl

pytestmark = pytest.mark.usefixtures("two_torch_threads")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompt(question, colour):
    """A system turn, a text-only user turn, a few-shot answer, then the image inside the last user turn's text.
    (Parts throughout: as in TRL, a user turn given as a plain string would take the row's images before its text.)"""
    return [{"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello. Ask me."}]},
            {"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"},
                                         {"type": "text", "text": f" ({colour})"}]}]


def _write(folder, n=8):
    os.makedirs(folder, exist_ok=True)
    rows = []
    for i in range(n):
        colour = ["red", "green", "blue", "yellow"][i % 4]
        Image.new("RGB", (56, 56), colour).save(os.path.join(folder, f"{i}.png"))
        rows.append({"prompt": _prompt("What colour is this?", colour), "images": [f"{i}.png"],
                     "solution": colour, "level": i % 3})
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return os.path.join(folder, "train.jsonl")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3", "internvl"])
def test_conversational_prompts_go_through_every_logprob_pass(family_models, family, tmp_path):
    model, processor = family_models(family)
    rows = load_prompt_set(_write(str(tmp_path / "data"), 2))
    messages = [prompt_messages(r) for r in rows]
    images = [prompt_images(r) for r in rows]
    index = [0, 0, 1, 1]
    prompts = encode_prompts(processor, messages, images, sample_ids=["a", "b"])
    repeated = encode_prompts(processor, [messages[i] for i in index], [images[i] for i in index],
                              sample_ids=list("abcd"))
    text = processor.apply_chat_template(messages[0], tokenize=False, add_generation_prompt=True)
    assert "Answer in one word." in text and text.index("Hello. Ask me.") < text.index("What colour")
    completion, mask = completions(processor.tokenizer, 4)
    expected = plain_logprobs(model, repeated, completion, mask)
    with torch.no_grad():
        torch.testing.assert_close(CompletionLogProbs(model)(repeated, completion, mask) * mask, expected,
                                   atol=2e-5, rtol=1e-4)
        if can_share_prompts(model, [1, 1]):
            shared = CompletionLogProbs(model)(prompts, completion, mask, prompt_index=torch.tensor(index))
            torch.testing.assert_close(shared * mask, expected, atol=2e-5, rtol=1e-4)
        from utils.core.packing import packing_unsupported_reason

        if packing_unsupported_reason(model) is None:
            packed = CompletionLogProbs(model, padding_free=True)(prompts, completion, mask,
                                                                   prompt_index=torch.tensor(index))
            torch.testing.assert_close(packed * mask, expected, atol=2e-5, rtol=1e-4)
    assert can_share_prompts(model, [1, 1]) == (family != "internvl")


def seen_by_reward(completions, prompts, solution, level, **kwargs):
    """Records what the trainer passes (TRL's call): the prompts as messages, the other columns by name."""
    assert "prompt" not in kwargs and "images" in kwargs
    assert all(p[0]["role"] == "system" and p[-1]["content"][1] == {"type": "image"} for p in prompts)
    return [float(c[0]["content"].strip() == s) + 0.1 * lv for c, s, lv in zip(completions, solution, level)]


@pytest.mark.slow
def test_train_grpo_trains_on_a_trl_conversational_vlm_set_unchanged(tmp_path):
    from tiny.models import make_tiny_vlm

    data = _write(str(tmp_path / "data"))
    model = make_tiny_vlm(tmp_path / "qwen", seed=0)
    try:
        train_grpo.main(GRPOConfig(
            model_name_or_path=model, dataset_name=data, output_dir=str(tmp_path / "out"),
            reward_funcs=["tests.test_grpo_conversations:seen_by_reward", "trl.rewards:accuracy_reward"],
            per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
            learning_rate=1e-3, report_to="none", save_steps=2, logging_steps=1, log_completions=True))
    finally:
        fresh_accelerate_state()
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] == m["loss"] for m in metrics)
    rows = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert rows[0]["prompt"] == "What colour is this? (red)" or rows[0]["prompt"].startswith("What colour is this?")


def _doc_example():
    """The TRL example of docs/data.md: its Python block and its command line."""
    with open(os.path.join(REPO, "docs", "data.md"), encoding="utf-8") as f:
        page = f.read()
    section = page[page.index("## TRL's formats"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(accelerate launch train_grpo.py .*?)```", section, re.S).group(1)
    return code, command.replace("\\\n", " ").split()


@pytest.mark.slow
def test_the_trl_example_of_docs_data_runs_as_written(tmp_path, monkeypatch):
    from utils.core.config import parse_config

    code, command = _doc_example()
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/data.md", "exec"), {})
    args = command[command.index("train_grpo.py") + 1:]
    cfg = parse_config(GRPOConfig, args + ["--max_steps", "1", "--report_to", "none", "--eval_dataset_name", "none",
                                           "--per_device_train_batch_size", "4", "--num_generations", "4",
                                           "--max_completion_length", "8"])
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    (metrics,) = read_jsonl(tmp_path / cfg.output_dir / "metrics.jsonl")
    assert metrics["step"] == 1 and "rewards/trl.rewards:accuracy_reward" in metrics


def strings_only(prompts, completions, answer, **kwargs):
    """TRL's standard format: prompts and completions are strings."""
    assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
    return [float(len(c)) for c in completions]


@pytest.mark.slow
def test_plain_text_prompts_train_a_text_model_without_a_chat_template(tmp_path):
    """TRL's standard format: the prompt string is the model's input as it is (no template), the completions
    strings in TRL's call."""
    from tiny.models import make_tiny_llm

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "answer": str(2 * i)}) + "\n" for i in range(8)))
    model = make_tiny_llm(tmp_path / "llm", seed=0)
    try:
        train_grpo.main(GRPOConfig(
            model_name_or_path=model, dataset_name=str(data), output_dir=str(tmp_path / "out"), image_column=None,
            reward_funcs=["tests.test_grpo_conversations:strings_only"], per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=6, max_steps=1, learning_rate=1e-3, report_to="none", save_steps=1,
            log_completions=True))
    finally:
        fresh_accelerate_state()
    rows = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert {r["prompt"] for r in rows} <= {f"{i} + {i} =" for i in range(8)} and len(rows) == 8
