"""train_mixgrpo.py's resume in this process, bit for bit: 5 steps with a checkpoint after step 3 (a reason step, so
the resumed run's first step reflects on the checkpointed buffer), then a run rebuilt from checkpoint-3 that trains
steps 4 and 5. Its metrics, drawn prompts, completions, scores and final weights equal the uninterrupted run's.
(tests/test_mixgrpo.py's SIGKILL test checks the same through a killed launch, in the full tier.)"""

import os

import pytest
from safetensors.torch import load_file

import train_mixgrpo as tm
from tests.launch_helpers import failing_fixture, fresh_accelerate_state
from tests.test_mixgrpo import TINY_CFG
from utils.core.tracking import read_jsonl


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    from tiny.pipelines import make_tiny_qwenimage

    with failing_fixture("tests/test_mixgrpo_resume.py's tiny Qwen-Image pipeline"):
        return make_tiny_qwenimage(str(tmp_path_factory.mktemp("mixgrpo-resume") / "qwenimage"))


def run(generator, out, **overrides):
    cfg = tm.MixGRPOConfig(**{**TINY_CFG, **dict(
        model_name_or_path=os.path.join(generator, "_vlm"), generator_name_or_path=generator, output_dir=str(out),
        max_steps=5, save_steps=3, log_completions=8, learning_rate=1e-3, warmup_steps=0, val_data_path=None,
        cpu_threads=1), **overrides})
    try:
        return tm.main(cfg)
    finally:  # the next run in this process starts from a fresh accelerate state, as a launched one would
        fresh_accelerate_state()


@pytest.mark.slow
def test_resume_from_a_checkpoint_matches_uninterrupted_run_bit_for_bit(generator, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run(generator, full)
    assert (full / "checkpoint-3" / "reflect_buffer" / "images.pt").exists()
    run(generator, resumed, resume_from_checkpoint=str(full / "checkpoint-3"))
    assert not (resumed / "checkpoint-3").exists()  # it started at step 4
    a = {m["step"]: m for m in read_jsonl(full / "metrics.jsonl") if "loss" in m}
    b = {m["step"]: m for m in read_jsonl(resumed / "metrics.jsonl") if "loss" in m}
    assert sorted(a) == [1, 2, 3, 4, 5] and sorted(b) == [4, 5]
    assert "reflect/score" in b[4] and "reason/score" in b[5]  # the resumed run reflects first
    for step in (4, 5):
        numbers = [k for k, v in a[step].items() if isinstance(v, float) and "time" not in k and "memory" not in k]
        assert len(numbers) > 10, a[step]
        for key in numbers:
            assert b[step][key] == a[step][key], (step, key, a[step][key], b[step][key])

    def drawn(run_dir):
        return [(r["step"], r["id"], r["prompt"], r["completion"], r["score"])
                for r in read_jsonl(run_dir / "completions.jsonl") if r["step"] >= 4]

    assert drawn(resumed) == drawn(full) and len(drawn(full)) == 16
    for part in ("model.safetensors", os.path.join("generator_lora", "pytorch_lora_weights.safetensors")):
        x, y = load_file(str(full / "checkpoint-5" / part)), load_file(str(resumed / "checkpoint-5" / part))
        assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x), part
