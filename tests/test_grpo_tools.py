"""train_grpo.py with --tools end to end on tiny models that have learnt to call them (tests/tool_helpers.py): one
tool returns an image, one raises, one sleeps past its timeout. The logged trajectories are checked against the
model: tool tokens masked, log-probs of the model's tokens equal to a plain forward over the whole trajectory,
errors and timeouts returned to the model, tool images saved beside completions.jsonl; the run resumes exactly
after kill -9; a family without a tool format is refused before training."""

import json
import os

import pytest
import torch
from PIL import Image

import train_grpo
from tests.launch_helpers import cli, finish, fresh_accelerate_state, launch, sigkill_when
from tests.tool_helpers import TIMEOUT, TOOLS, tool_caller, trace_rows
from train_grpo import GRPOConfig
from utils.core.config import ConfigError
from utils.core.tracking import read_jsonl


@pytest.fixture(scope="module")
def callers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-callers")
    folder = trace_rows(str(root / "data"))
    built = {}

    def get(family):
        if family not in built:
            built[family] = tool_caller(str(root / family), family, folder)
        return built[family], folder

    return get


def flags(model, folder, out, **overrides):
    base = dict(model_name_or_path=model, dataset_name=os.path.join(folder, "train.jsonl"), output_dir=str(out),
                tools=TOOLS, tool_timeout=TIMEOUT, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=640, max_prompt_length=1536, temperature=0.05, max_steps=2,
                learning_rate=1e-4, reward_funcs=["math_accuracy", "tool_format", "tool_budget"],
                reward_kwargs={"tool_budget": {"max_calls": 3}}, prompt_template="think_answer", report_to="none",
                save_steps=1, logging_steps=1, log_completions=True, seed=0, max_pixels=84 * 84)
    base.update(overrides)
    return base


def run(**kwargs):
    try:
        return train_grpo.main(GRPOConfig(**kwargs))
    finally:
        fresh_accelerate_state()


def _plain_logps(model, processor, prompt, tools, images, token_ids, temperature):
    from utils.core.encoding import encode_prompts

    prompt_batch = encode_prompts(processor, [prompt], [images[:1]], sample_ids=["p"], tools=tools)
    ids = torch.cat([prompt_batch["input_ids"][0], torch.tensor(token_ids)])[None]
    pixels = processor.image_processor(images=images, return_tensors="pt")
    image_token = processor.image_token_id
    mm = (ids == image_token).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm,
                       pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"]).logits[0]
    n = prompt_batch["input_ids"].shape[1]
    logps = torch.log_softmax(logits[n - 1:-1].float() / temperature, -1)  # the run's temperature, as trained
    return logps.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.full)])
def test_tool_trajectories_are_logged_masked_and_scored_as_a_plain_forward(callers, family, tmp_path):
    from utils.core.models import load_model_and_processor
    from utils.core.tools import ToolBox

    model_path, folder = callers(family)
    run(**flags(model_path, folder, tmp_path))
    rows = [r for r in read_jsonl(tmp_path / "completions.jsonl") if r["step"] == 1]
    assert len(rows) == 4
    model, processor = load_model_and_processor(model_path, max_pixels=84 * 84)
    tokenizer = processor.tokenizer
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Use the tools."}]}]
    scene = Image.open(os.path.join(folder, "scene.png")).convert("RGB")
    for row in rows:
        roles = [m["role"] for m in row["turns"]]
        assert roles[:2] == ["assistant", "tool"] and row["tool_calls"] >= 3, roles
        tool_messages = [m for m in row["turns"] if m["role"] == "tool"]
        # the image came back (saved beside completions.jsonl), the exception and the timeout as errors
        image_part = tool_messages[0]["content"][0]
        assert image_part["type"] == "image" and os.path.isfile(tmp_path / image_part["image"])
        errors = [json.loads(m["content"][0]["text"])["error"] for m in tool_messages[1:3]]
        assert errors == ["RuntimeError: broken tool called with 3", f"sleepy timed out after {TIMEOUT:g} s"]
        assert row["tool_errors"] >= 2 and row["tool_timeouts"] >= 1
        # the masked tokens are the template's (tool results included); the model's decode to its own turns
        ids, mask = row["token_ids"], row["model_mask"]
        tool_text = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        assert "<tool_response>" in tool_text and "broken tool called" in tool_text and "<tool_call>" not in tool_text
        assert "<tool_call>" in tokenizer.decode([t for t, m in zip(ids, mask) if m == 1])
        # log-probs of the model's tokens: one plain forward of the step-1 policy over prompt + trajectory
        images = [scene] + [Image.open(tmp_path / p["image"]).convert("RGB") for m in tool_messages
                            for p in m["content"] if p["type"] == "image"]
        plain = _plain_logps(model, processor, prompt, ToolBox(TOOLS).schemas, images, ids, temperature=0.05)
        keep = torch.tensor(mask).bool()
        logged = torch.tensor(row["logps"])
        assert torch.allclose(logged[keep], plain[keep], atol=1e-4), (logged[keep] - plain[keep]).abs().max()
        assert (logged[~keep] == 0).all()
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert metrics[0]["tools/call_frequency"] >= 3 and metrics[0]["tools/failure_frequency"] > 0
    assert metrics[0]["tools/timeouts"] >= 1 and metrics[0]["tools/tool_tokens"] > 0
    assert metrics[0]["rewards/tool_format"] == 0.0  # every trajectory had a failed call


@pytest.mark.slow
@pytest.mark.full
def test_kill_9_then_resume_matches_the_uninterrupted_tool_run(callers, tmp_path):
    model_path, folder = callers("qwen2_5_vl")
    args = flags(model_path, folder, tmp_path / "full", max_steps=4, save_steps=2)
    args.update(temperature=1.0, tools=",".join(TOOLS), reward_kwargs=json.dumps(args["reward_kwargs"]),
                reward_funcs=",".join(args["reward_funcs"]))
    finish(launch("train_grpo.py", cli(**args)))
    victim = launch("train_grpo.py", cli(**dict(args, output_dir=str(tmp_path / "killed"))))
    sigkill_when(victim, tmp_path / "killed" / "checkpoint-2", timeout=600)
    finish(launch("train_grpo.py", cli(**dict(args, output_dir=str(tmp_path / "killed"),
                                             resume_from_checkpoint="latest"))))
    full = {m["step"]: m for m in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    resumed = {m["step"]: m for m in read_jsonl(tmp_path / "killed" / "metrics.jsonl")}
    for step in (3, 4):
        for key in ("reward", "loss", "tools/call_frequency", "tools/tool_tokens"):
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5, abs=1e-6), (step, key)

    def trajectories(run_dir):
        return [(r["step"], r["id"], r["token_ids"], r["model_mask"]) for r in
                read_jsonl(run_dir / "completions.jsonl") if r["step"] >= 3]

    assert trajectories(tmp_path / "killed") == trajectories(tmp_path / "full")


def test_a_family_without_a_tool_format_is_refused_before_training(tmp_path):
    from tiny.models import make_tiny_vlm

    model = make_tiny_vlm(tmp_path / "gemma3", family="gemma3", seed=0)
    folder = trace_rows(str(tmp_path / "data"))
    with pytest.raises(ConfigError, match="the chat template of .* renders no tool calls"):
        run(**flags(model, folder, tmp_path / "out", max_pixels=None))
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_bad_tool_flags_fail_before_loading(tmp_path):
    for kwargs, message in (({"tools": ["nope"]}, "not a built-in tool"),
                            ({"tools": [], "max_tool_calling_iterations": 2}, "apply to --tools"),
                            ({"tool_timeout": 0}, "--tool_timeout 0 must be > 0"),
                            ({"dynamic_sampling": True}, "--dynamic_sampling")):
        with pytest.raises(ConfigError, match=message):
            run(**flags("tiny", str(tmp_path), tmp_path / "out", **kwargs))


@pytest.mark.slow
def test_the_vllm_path_runs_the_same_loop_on_the_fake_engine(tmp_path, monkeypatch):
    """The fake engine (tests/vllm_helpers.py) writes a snapshot call until the prompt holds a tool result, then an
    answer: each later turn goes to the engine as the context's ids with every image so far, and its log-probs
    come back on the model's tokens only."""
    import sys

    import utils.core.vllm_rollout
    from tests.vllm_helpers import FakeVLLM, request_output
    from tiny.models import make_tiny_vlm
    from utils.core.models import load_model_and_processor

    model = make_tiny_vlm(tmp_path / "qwen", seed=0)
    tokenizer = load_model_and_processor(model)[1].tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer('<tool_call>\n{"name": "snapshot", "arguments": {"n": 2}}\n</tool_call>',
                     add_special_tokens=False).input_ids + [end]
    answer = tokenizer("<answer>red</answer>", add_special_tokens=False).input_ids + [end]
    seen = []

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", len(prompts)))
        outs = []
        for prompt in prompts:
            images = prompt.get("multi_modal_data", {}).get("image")
            seen.append((len(prompt["prompt_token_ids"]), 1 if not isinstance(images, list) else len(images)))
            tokens = answer if "tool_response" in tokenizer.decode(prompt["prompt_token_ids"]) else call
            outs.append(request_output(prompt["prompt_token_ids"], tokens, [-0.5] * len(tokens)))
        return outs

    monkeypatch.setattr(FakeVLLM.LLM, "generate", generate)
    monkeypatch.setitem(sys.modules, "vllm", FakeVLLM)
    monkeypatch.setattr(utils.core.vllm_rollout, "require_vllm", lambda: FakeVLLM)
    monkeypatch.setattr(train_grpo, "require_vllm", lambda: FakeVLLM)
    FakeVLLM.engines.clear()
    folder = trace_rows(str(tmp_path / "data"))
    run(**flags(model, folder, tmp_path / "out", use_vllm=True, max_steps=1, temperature=1.0))
    (engine,) = FakeVLLM.engines
    assert [c[0] for c in engine.calls].count("generate") == 2  # the first turns, then the turns after the call
    assert [n for _, n in seen] == [1] * 4 + [2] * 4  # the second turn's prompts carry the tool's image too
    (metrics,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["completion_length"] == len(call) + len(answer)  # the model's tokens only
    assert metrics["vllm/logp_diff_mean"] > 0 and metrics["rewards/math_accuracy"] == 1.0
    for row in read_jsonl(tmp_path / "out" / "completions.jsonl"):
        assert sum(row["model_mask"]) == len(call) + len(answer) and row["tool_tokens"] > 0


@pytest.mark.slow
def test_evaluate_runs_the_tool_loop_and_grades_the_final_answer(callers, tmp_path):
    import evaluate

    model_path, folder = callers("qwen2_5_vl")
    metrics = evaluate.main(evaluate.EvalConfig(
        model=model_path, dataset=os.path.join(folder, "train.jsonl"), split="train", tools=TOOLS,
        tool_timeout=TIMEOUT, max_new_tokens=640, metrics=["accuracy"], prompt_template="think_answer",
        max_pixels=84 * 84, output_dir=str(tmp_path / "eval")))
    records = read_jsonl(tmp_path / "eval" / "generations.jsonl")
    assert metrics["samples"] == 4 and metrics["accuracy"] == 1.0  # the answer after three tool calls
    assert all(r["question"] == "Use the tools." and r["predicted_answer"] == "red" for r in records)


def test_evaluate_reads_a_trl_conversational_set(tmp_path):
    import evaluate
    from tiny.models import make_tiny_vlm

    model = make_tiny_vlm(tmp_path / "qwen", seed=0)
    folder = trace_rows(str(tmp_path / "data"))
    metrics = evaluate.main(evaluate.EvalConfig(model=model, dataset=os.path.join(folder, "train.jsonl"),
                                                split="train", max_new_tokens=4, metrics=["accuracy"],
                                                output_dir=str(tmp_path / "eval")))
    records = read_jsonl(tmp_path / "eval" / "generations.jsonl")
    assert metrics["samples"] == 4 and [r["answer"] for r in records] == ["red"] * 4
    assert records[0]["question"] == "Use the tools." and records[0]["id"] == "p0"
    with pytest.raises(ValueError, match="--tools runs the tool loop on a local --model"):
        evaluate.main(evaluate.EvalConfig(base_url="http://127.0.0.1:1/v1", served_model_name="m", tools=TOOLS,
                                          dataset=os.path.join(folder, "train.jsonl"), split="train"))


@pytest.mark.slow
@pytest.mark.full
def test_two_processes_sample_and_train_the_one_process_trajectories(callers, tmp_path):
    """Each turn's seeds come from the completion's global index, so two processes build the trajectories one
    process builds (the tool loop runs a different number of turns on each process without waiting)."""
    model_path, folder = callers("qwen2_5_vl")
    args = flags(model_path, folder, tmp_path / "one", temperature=1.0)
    args.update(tools=",".join(TOOLS), reward_kwargs=json.dumps(args["reward_kwargs"]),
                reward_funcs=",".join(args["reward_funcs"]))
    finish(launch("train_grpo.py", cli(**args)))
    finish(launch("train_grpo.py", cli(**dict(args, output_dir=str(tmp_path / "two"), per_device_train_batch_size=2)),
                  num_processes=2))

    def trajectories(run_dir):
        return [(r["step"], r["id"], r["token_ids"], r["model_mask"], r["tool_calls"])
                for r in read_jsonl(run_dir / "completions.jsonl")]

    assert trajectories(tmp_path / "two") == trajectories(tmp_path / "one")
    one, two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    for a, b in zip(one, two):
        assert a["tools/call_frequency"] == b["tools/call_frequency"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
