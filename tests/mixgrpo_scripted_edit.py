"""train_mixgrpo.py in which every reflection reads as the edit instruction "add a red circle" (a random tiny VLM
almost never writes `<think>..</think>` and an instruction, so its refine samples would all keep their image and
train nothing). Launched as the script is: `accelerate launch tests/mixgrpo_scripted_edit.py <train_mixgrpo flags>`;
the VLM still samples (and trains on) its own tokens."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_mixgrpo as tm  # noqa: E402
from utils.core.config import parse_config  # noqa: E402


def scripted_reflection(text):
    return 1.0, "add a red circle", False  # (format, instruction, image kept)


if __name__ == "__main__":
    tm.reflection_of = scripted_reflection
    with tm.exit_on_bad_input("train_mixgrpo.py"):
        tm.main(parse_config(tm.MixGRPOConfig, sys.argv[1:]))
