"""train_mixgrpo.py against a GenEval-protocol server on loopback: requests go to the server's base path "/", the
script trains on the reply's `scores` (not the binary `rewards`), and a server that keeps failing stops the run
with its error instead of scoring the images 0."""

import io
import os
import pickle

import numpy as np
import pytest
from PIL import Image

import train_mixgrpo as tm
from rewards.geneval import RewardServerError
from tests.test_reward_servers import Loopback
from tiny.t2i import make_t2i_prompts, write_jsonl
from utils.core.tracking import read_jsonl


def brightness_server(body):
    """A GenEval-protocol server whose score is the image's mean brightness (the binary reward: > 0.5)."""
    request = pickle.loads(body)
    scores = [float(np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), dtype=np.float64).mean() / 255)
              for b in request["images"]]
    reply = {"scores": scores, "rewards": [float(s > 0.5) for s in scores], "strict_rewards": [0.0] * len(scores),
             "group_rewards": {}, "group_strict_rewards": {}}
    return 200, pickle.dumps(reply)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tiny.pipelines import make_tiny_qwenimage

    root = tmp_path_factory.mktemp("mixgrpo-rewards")
    gen = make_tiny_qwenimage(str(root / "qwenimage"))
    prompts = write_jsonl(make_t2i_prompts(8, seed=0), str(root / "geneval.jsonl"))
    return dict(gen=gen, prompts=prompts)


def run(assets, out, port, **overrides):
    from accelerate.state import AcceleratorState, GradientState

    cfg = tm.MixGRPOConfig(**{**dict(
        model_name_or_path=os.path.join(assets["gen"], "_vlm"), generator_name_or_path=assets["gen"],
        dataset_name="geneval", train_data_path=assets["prompts"], val_data_path=None, reward_fn="geneval",
        reward_server_urls="http://127.0.0.1", reward_server_port=str(port),
        reward_kwargs={"max_retries": 1, "backoff": 0.01, "timeout": 30.0}, group_size=4, policy_group_size=1,
        prompts_per_policy_group=1, max_output_token_n_gen=4, max_output_token_n_edit=4, image_size=32,
        num_timesteps_gen=3, num_timesteps_edit=3, generator_lora_r=4, max_steps=2, save_steps=100,
        report_to="none", output_dir=str(out), seed=0), **overrides})
    try:
        return tm.main(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.slow
def test_geneval_server_scores_train_the_reason_and_refine_steps(assets, tmp_path, monkeypatch):
    # the random tiny VLM writes no reflection, which keeps its image: read every reflection as an edit
    monkeypatch.setattr(tm, "reflection_of", lambda text: (1.0, "add a red circle", False))
    server = Loopback(lambda attempt, path, body: brightness_server(body))
    try:
        run(assets, tmp_path, server.port)
    finally:
        server.close()
    assert [path for path, _, _ in server.requests] == ["/", "/"]  # the base path, never .../v1
    sent = [pickle.loads(body) for _, body, _ in server.requests]
    assert [len(s["images"]) for s in sent] == [4, 4]  # the reason images, then the refined ones
    assert all(m["prompt"].startswith("a photo of") and "include" in m for s in sent for m in s["meta_datas"])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    served = [brightness_server(body) for _, body, _ in server.requests]
    scores = [pickle.loads(reply)["scores"] for _, reply in served]
    assert metrics[0]["reason/score"] == pytest.approx(np.mean(scores[0]), abs=1e-6)  # `scores`, not `rewards`
    assert metrics[1]["reflect/score"] == pytest.approx(np.mean(scores[1]), abs=1e-6)
    assert metrics[0]["reason/image_reward"] == pytest.approx(np.mean(scores[0]), abs=1e-6)


@pytest.mark.slow
def test_a_failing_reward_server_stops_the_run_instead_of_scoring_zero(assets, tmp_path):
    server = Loopback(lambda attempt, path, body: (503, b"overloaded"))
    try:
        with pytest.raises(RewardServerError):
            run(assets, tmp_path, server.port, max_steps=1)
    finally:
        server.close()
    assert len(server.requests) == 2  # the request and its one retry
    assert not (tmp_path / "metrics.jsonl").exists() or read_jsonl(tmp_path / "metrics.jsonl") == []


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.full  # a `transformers serve` of its own; the GenEval server test above keeps the reward path fast
def test_vlm_judge_served_by_transformers_serve_scores_both_stages(assets, tmp_path):
    """The GenEval++ judge is the tiny VLM behind `transformers serve` (transformers' own OpenAI-compatible
    server): every reason and refine image goes to /v1/chat/completions and its reply becomes the score."""
    import subprocess
    import sys
    import time

    import requests

    vlm = os.path.join(assets["gen"], "_vlm")
    port = free_port()
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    server = subprocess.Popen([cli, "serve", vlm, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                               "--log-level", "info"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 180
        while True:
            assert server.poll() is None and time.time() < deadline, "transformers serve did not start"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.exceptions.ConnectionError:
                time.sleep(0.5)
        prompts = write_jsonl(make_t2i_prompts(4, seed=0), str(tmp_path / "geneval_plus.jsonl"))
        run(assets, tmp_path / "run", port, dataset_name="geneval_plus", train_data_path=prompts,
            reward_fn="judge_geneval_plus", reward_kwargs={"model": vlm, "max_tokens": 8, "max_retries": 1})
    finally:
        os.killpg(server.pid, 9)
        log = server.communicate()[0]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert "reason/score" in metrics[0] and "reflect/score" in metrics[1]
    # a random tiny VLM's reply is mostly no verdict: left out of the advantages and counted, never scored 0
    for m, stage in zip(metrics, ("reason", "reflect")):
        assert 0 <= m[f"{stage}/unscored"] <= 1 and (m[f"{stage}/unscored"] == 1 or 0 <= m[f"{stage}/score"] <= 1)
    # 4 reason images + each refined one (a reflection without an edit keeps its image, which is not re-scored)
    edited = round(4 * (1 - metrics[1]["reflect/no_edit"]))
    assert log.count("/v1/chat/completions") == 4 + edited, log[-2000:]


@pytest.mark.parametrize("dataset, row, message", [
    ("geneval", {"tag": "counting", "prompt": "two circles", "include": [{"class": "circle", "count": 0}]},
     r"row 1.*include.*count"),
    ("tiif", {"type": "x", "short_description": "a cat", "yn_question_list": ["is it a cat?"],
              "yn_answer_list": ["maybe"]}, r"row 1.*yn_answer_list"),
])
def test_a_bad_prompt_row_is_refused_with_the_row_named_before_any_model_loads(tmp_path, monkeypatch, dataset, row,
                                                                              message):
    from utils.core.errors import DataValidationError

    good = dict(tag="single_object", prompt="a circle", include=[{"class": "circle", "count": 1}]) \
        if dataset == "geneval" else dict(type="x", short_description="a dog", yn_question_list=["a dog?"],
                                          yn_answer_list=["yes"])
    path = write_jsonl([good, row], str(tmp_path / "prompts.jsonl"))
    monkeypatch.setattr(tm, "build_policy", lambda *a, **k: pytest.fail("a model was loaded before the data check"))
    cfg = dict(dataset_name=dataset, train_data_path=path, val_data_path=None, output_dir=str(tmp_path / "out"),
               report_to="none", policy_group_size=1, model_name_or_path="unused", generator_name_or_path="unused",
               reward_fn="judge_tiif" if dataset == "tiif" else "geneval")
    from accelerate.state import AcceleratorState, GradientState

    try:
        with pytest.raises(DataValidationError, match=message):
            tm.main(tm.MixGRPOConfig(**cfg))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
