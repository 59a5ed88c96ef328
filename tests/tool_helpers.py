"""Tools and a tool-calling tiny model for the tool tests: one tool returns an image, one raises, one sleeps past its
timeout (short docstrings: their schemas are the prompt's longest part). `tool_caller` SFTs a tiny VLM on one trace
that calls all three and answers, so GRPO's rollouts call them (with a low temperature)."""

import json
import os
import time

from PIL import Image

TOOLS = ["tests.tool_helpers:snapshot", "tests.tool_helpers:broken", "tests.tool_helpers:sleepy"]
TIMEOUT = 0.5
QUESTION = "Use the tools."


def snapshot(n: int):
    """Shows an image.

    Args:
        n: Its side, in cells.
    """
    return Image.new("RGB", (28 * n, 28 * n), (40, 80, 220))


def broken(x: int) -> str:
    """Fails.

    Args:
        x: Any number.
    """
    raise RuntimeError(f"broken tool called with {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def scene():
    image = Image.new("RGB", (84, 84), "white")
    image.paste((220, 40, 40), (0, 0, 42, 42))
    return image


CALLS = [{"name": "snapshot", "arguments": {"n": 2}},
         {"name": "broken", "arguments": {"x": 3}},
         {"name": "sleepy", "arguments": {"seconds": 30}}]


def trace_rows(folder):
    """The SFT trace (LLaMA-Factory sharegpt with function_call / observation turns) and the GRPO prompts (TRL's
    conversational format), both with the scene image, written into `folder`."""
    from utils.core.tools import ToolBox

    os.makedirs(folder, exist_ok=True)
    scene().save(os.path.join(folder, "scene.png"))
    snapshot(**CALLS[0]["arguments"]).save(os.path.join(folder, "zoom.png"))
    errors = [json.dumps({"error": "RuntimeError: broken tool called with 3"}),
              json.dumps({"error": f"sleepy timed out after {TIMEOUT:g} s"})]
    turns = [{"from": "human", "value": "<image>" + QUESTION},
             {"from": "function_call", "value": json.dumps(CALLS[0])}, {"from": "observation", "value": "<image>"},
             {"from": "function_call", "value": json.dumps(CALLS[1])}, {"from": "observation", "value": errors[0]},
             {"from": "function_call", "value": json.dumps(CALLS[2])}, {"from": "observation", "value": errors[1]},
             {"from": "gpt", "value": "<answer>red</answer>"}]
    schemas = ToolBox(TOOLS).schemas
    with open(os.path.join(folder, "sft.jsonl"), "w") as f:
        f.write(json.dumps({"messages": turns, "images": ["scene.png", "zoom.png"], "tools": json.dumps(schemas)})
                + "\n")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"p{i}", "prompt": prompt, "images": ["scene.png"], "answer": "red"}) + "\n")
    return folder


def tool_caller(out, family, folder, steps=60):
    """A tiny `family` VLM that has learnt the trace by heart (train_sft.py on it); returns its checkpoint."""
    import train_sft
    from tests.launch_helpers import fresh_accelerate_state
    from tiny.models import make_tiny_vlm
    from utils.core.checkpoint import latest_checkpoint

    base = make_tiny_vlm(os.path.join(out, "base"), family=family, seed=0)
    try:
        train_sft.main(train_sft.SFTConfig(
            model_name_or_path=base, dataset_name=os.path.join(folder, "sft.jsonl"), dataset_format="sharegpt",
            output_dir=os.path.join(out, "sft"), max_steps=steps, per_device_train_batch_size=1, learning_rate=5e-3,
            lr_scheduler_type="constant", max_length=2048, report_to="none", save_steps=steps, logging_steps=steps,
            eval_dataset_name=None, seed=0, max_pixels=84 * 84))
    finally:
        fresh_accelerate_state()
    return latest_checkpoint(os.path.join(out, "sft"))
