"""--vllm_mode server on the CPU: utils/core/vllm_client.py against tests/vllm_standin_server.py, a real process on
127.0.0.1 that serves vllm_serve.py's protocol (TRL's `trl vllm-serve` endpoints) over transformers and joins the
weight-update group over gloo. The protocol itself (payloads, errors, the command order), how a round's prompts become
one request, the flags' refusals, and GRPO runs whose weight pushes are checked: after every optimizer step the
server's weights equal the trainer's checkpoint, and every round samples from the weights the trainer scores with."""

import json
import math
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import requests
import torch
from safetensors.torch import load_file

import train_grpo
from tests.launch_helpers import REPO, cli, finish, free_port, fresh_accelerate_state, launch
from tiny.models import make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from utils.core.config import ConfigError
from utils.core.encoding import encode_prompts
from utils.core.models import load_model_and_processor
from utils.core.prompts import build_messages
from utils.core.rollout import special_token_ids_to_suppress, stop_token_ids
from utils.core.tracking import read_jsonl
from utils.core.vllm_client import ServerError, VLLMClient, server_base_url
from utils.core.vllm_flags import check_vllm_flags
from utils.core.vllm_rollout import pack_completions, prompt_token_ids
from utils.core.vllm_server_rollout import group_requests, sampled_logprobs, server_sampling


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-server")
    data = str(root / "shapes")
    make_shapes_vqa(32, seed=0, kinds=("color", "count")).save_to_disk(data)
    return {"model": make_tiny_vlm(str(root / "vlm"), seed=0), "data": data, "root": root}


class StandIn:
    """tests/vllm_standin_server.py as a process on 127.0.0.1 (its own session, killed at the end)."""

    def __init__(self, model, dump_dir):
        self.port, self.dump_dir = free_port(), str(dump_dir)
        self.log = open(os.path.join(self.dump_dir + ".log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "vllm_standin_server.py"), "--model", model,
             "--port", str(self.port), "--dump_dir", self.dump_dir],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return VLLMClient(self.url, group_port=free_port(), connection_timeout=120.0, **kw)

    def requests(self):
        return read_jsonl(os.path.join(self.dump_dir, "requests.jsonl"))

    def sync(self, k):
        return load_file(os.path.join(self.dump_dir, f"sync-{k}.safetensors"))

    def syncs(self):
        return sorted(int(f[5:-12]) for f in os.listdir(self.dump_dir) if f.startswith("sync-"))

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()


@pytest.fixture
def standin(assets, tmp_path):
    server = StandIn(assets["model"], tmp_path / "server")
    yield server
    server.stop()


def prompts(model, processor, n=2):
    rows = make_shapes_vqa(n, seed=3)
    messages = [build_messages(r["question"], num_images=1) for r in rows]
    images = [[r["image"]] for r in rows]
    batch = encode_prompts(processor, messages, images, sample_ids=[str(i) for i in range(n)])
    return prompt_token_ids(batch), images


# ----------------------------------------------------------------------------------------------
# the protocol against the stand-in process
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_and_weight_updates_over_the_protocol(assets, standin):
    model, processor = load_model_and_processor(assets["model"])
    tok = processor.tokenizer
    client = standin.client()
    assert client.world_size() == 1
    ids, images = prompts(model, processor)
    stop = stop_token_ids(model, tok)
    suppress = special_token_ids_to_suppress(tok, stop)
    cfg = SimpleNamespace(temperature=0.9, top_p=1.0, top_k=None, max_completion_length=6)
    out = client.generate(ids, images, n=3, **server_sampling(cfg, stop_ids=stop, suppress_ids=suppress,
                                                               vocab_size=model.config.text_config.vocab_size))
    assert out["prompt_ids"] == ids and len(out["completion_ids"]) == 6  # n completions per prompt, prompt-major
    for row, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert 1 <= len(row) <= 6 and len(lps) == len(row) and [c[0] for c in lp_ids] == row
        assert not set(row) & set(suppress)  # the suppressed tokens never come back
        assert len(row) == 6 or row[-1] in stop
    (request,) = standin.requests()
    assert request["images"] == [1, 1] and request["n"] == 3 and request["temperature"] == 0.9
    assert request["stop_token_ids"] == sorted(stop) and request["suppressed"] == len(suppress)

    # weights: the group forms, a pushed tensor is what the server holds after the round
    client.init_communicator("cpu")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    new = torch.randn_like(dict(model.named_parameters())[name])
    client.update_named_param(name, new)
    client.update_named_param("model.language_model.norm.weight", torch.full((model.config.text_config.hidden_size,),
                                                                              0.5))
    client.reset_prefix_cache()
    (k,) = standin.syncs()
    synced = standin.sync(k)
    assert torch.equal(synced[name], new) and synced["model.language_model.norm.weight"].eq(0.5).all()
    other = "model.language_model.layers.1.mlp.down_proj.weight"
    assert torch.equal(synced[other], dict(model.named_parameters())[other])  # untouched
    # a push the server cannot load is reported by the next request that waits for an answer, naming it
    client.update_named_param("no.such.weight", torch.zeros(2))
    with pytest.raises(ServerError, match="no.such.weight"):
        client.reset_prefix_cache()
    client.reset_prefix_cache()  # reported once; the server goes on
    client.close_communicator()


@pytest.mark.slow
def test_protocol_errors_and_an_absent_server(standin):
    standin.client()  # up
    assert requests.get(f"{standin.url}/health/").json() == {"status": "ok"}
    bad = requests.post(f"{standin.url}/generate/", json={"images": None})
    assert bad.status_code == 422 and "prompts" in bad.json()["detail"]
    bad = requests.post(f"{standin.url}/generate/", json={"prompts": [[1, 2]], "images": [None, None]})
    assert bad.status_code == 422 and "2 image lists for 1 prompts" in bad.json()["detail"]
    assert requests.post(f"{standin.url}/chat/", json={}).status_code == 404
    with pytest.raises(ServerError, match=r"no vLLM server answered at http://127.0.0.1:\d+ within 0.5 s"):
        VLLMClient(f"http://127.0.0.1:{free_port()}", connection_timeout=0.5)


# ----------------------------------------------------------------------------------------------
# one request per round, and what comes back
# ----------------------------------------------------------------------------------------------


def test_a_rounds_prompts_become_one_request():
    a, b, c = [1, 2], [3], [4, 5]
    # groups of 4 split over two processes (2 + 2) still ask each prompt for n completions in order
    entries = [(a, ["x"]), (a, ["x"]), (b, []), (b, []), (b, []), (b, []), (c, ["y"]), (c, ["y"])]
    assert group_requests(entries) == ([a, b, b, c], [["x"], [], [], ["y"]], 2)
    assert group_requests([(a, [])] * 4) == ([a], [[]], 4)
    assert group_requests([(a, ["x"]), (a, ["z"])]) == ([a, a], [["x"], ["z"]], 1)  # same ids, other images
    response = {"logprobs": [[[-0.5], [None]], [[-0.1, -2.0]]], "logprob_token_ids": [[[7], [8]], [[9, 3]]]}
    got = sampled_logprobs(response, [[7, 8], [9]])
    assert got[0][0] == -0.5 and math.isnan(got[0][1]) and got[1] == [-0.1]
    assert sampled_logprobs({"logprobs": None}, [[1]]) is None
    plain = sampled_logprobs({"logprobs": [[-0.5, -0.25]]}, [[7, 8]])  # one float per token, no ids
    assert plain == [[-0.5, -0.25]]
    assert sampled_logprobs({"logprobs": [[[-0.5]]], "logprob_token_ids": None}, [[7, 8]])[0][0] == -0.5
    ids, mask, lp = pack_completions([[5, 9, 0], [6]], [[-1.0, -2.0, -3.0], [-0.5]], [[1], [1]], [[1], [1]],
                                     pad_token_id=0, stop_ids=[9])
    assert ids.tolist() == [[5, 9, 0], [6, 0, 0]] and mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert lp[0].tolist() == [-1.0, -2.0, -3.0] and lp[1].tolist() == [-0.5, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="the vLLM server turned prompt 0 into 3 tokens.*--mm_processor_kwargs"):
        pack_completions([[5]], None, [[1, 1, 1]], [[1, 1]], pad_token_id=0, stop_ids=[9], where="the vLLM server")


def test_sampling_sent_to_the_server():
    cfg = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=None, max_completion_length=12)
    kw = server_sampling(cfg, stop_ids=[9, 4], suppress_ids=[1, 7], vocab_size=10)
    assert kw["generation_kwargs"] == {"stop_token_ids": [4, 9], "allowed_token_ids": [0, 2, 3, 4, 5, 6, 8, 9]}
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["max_tokens"], kw["logprobs"]) == (0.7, 0.9, 0, 12, 0)
    json.dumps(kw)  # plain JSON: no -inf, no integer keys
    assert "allowed_token_ids" not in server_sampling(cfg, stop_ids=[9], suppress_ids=[], vocab_size=10)[
        "generation_kwargs"]
    assert server_base_url(None, "10.0.0.7", 8001) == "http://10.0.0.7:8001"
    assert server_base_url("http://gen:9000/", "ignored", 1) == "http://gen:9000"


# ----------------------------------------------------------------------------------------------
# flags
# ----------------------------------------------------------------------------------------------


def flags(**over):
    return train_grpo.GRPOConfig(**over)


@pytest.mark.parametrize("over, message", [
    (dict(vllm_mode="remote"), "--vllm_mode 'remote' is not one of colocate, server"),
    (dict(vllm_mode="server"), "--vllm_mode server needs --use_vllm"),
    (dict(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2),
     "--vllm_tensor_parallel_size sets up a colocated engine.*vllm_serve.py --tensor_parallel_size"),
    (dict(use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.9),
     "--vllm_gpu_memory_utilization .*vllm_serve.py --gpu_memory_utilization"),
    (dict(use_vllm=True, vllm_mode="server", vllm_max_model_length=2048), "vllm_serve.py --max_model_len"),
    (dict(use_vllm=True, vllm_mode="server", vllm_enable_sleep_mode=True), "--vllm_enable_sleep_mode sets up"),
    (dict(use_vllm=True, vllm_server_port=8001), "--vllm_server_port is a setting of --vllm_mode server"),
    (dict(use_vllm=True, vllm_server_base_url="http://x:1"), "--vllm_server_base_url is a setting of"),
    (dict(vllm_server_port=70000), "--vllm_server_port 70000 is not a TCP port"),
    (dict(vllm_server_timeout=0.0), "--vllm_server_timeout 0.0 must be > 0"),
    (dict(vllm_tensor_parallel_size=0), "--vllm_tensor_parallel_size 0 must be >= 1"),
    (dict(vllm_max_model_len=1024, vllm_max_model_length=2048), "disagree"),
    (dict(vllm_structured_outputs_regex="[0-9]+"), "--vllm_structured_outputs_regex constrains"),
])
def test_vllm_flags_are_refused_with_their_reason(over, message):
    with pytest.raises(ConfigError, match=message):
        check_vllm_flags(flags(**over), 1)


def test_tensor_parallel_size_must_divide_the_processes():
    with pytest.raises(ConfigError, match="--vllm_tensor_parallel_size 2 must divide the 3 training processes"):
        check_vllm_flags(flags(use_vllm=True, vllm_tensor_parallel_size=2), 3)
    assert check_vllm_flags(flags(use_vllm=True, vllm_tensor_parallel_size=2), 4) is True  # needs vLLM here
    # server mode on the CPU: gloo, no vLLM in the trainer (on a GPU: vLLM's NCCL group)
    assert check_vllm_flags(flags(use_vllm=True, vllm_mode="server"), 3) is torch.cuda.is_available()
    assert check_vllm_flags(flags(), 1) is False
    with pytest.raises(ConfigError, match="--tools with --vllm_mode server on several processes"):
        check_vllm_flags(flags(use_vllm=True, vllm_mode="server", tools=["tests.grpo_helpers:nothing"]), 2)


# ----------------------------------------------------------------------------------------------
# GRPO through --vllm_mode server
# ----------------------------------------------------------------------------------------------


def server_run(assets, standin, out, **over):
    base = dict(model_name_or_path=assets["model"], dataset_name=assets["data"], output_dir=str(out),
                per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_prompt_length=256,
                max_steps=3, save_steps=1, learning_rate=1e-3, report_to="none", seed=0, eval_before=False,
                reward_funcs=["tests.grpo_helpers:completion_length"], use_vllm=True, vllm_mode="server",
                vllm_server_host="127.0.0.1", vllm_server_port=standin.port, vllm_group_port=free_port())
    base.update(over)
    return base


def check_pushes(standin, out, steps):
    """sync-0 went out before the first round; sync-k, after optimizer step k, holds the step-k checkpoint's weights."""
    from transformers import AutoModelForImageTextToText

    assert standin.syncs() == list(range(steps + 1))
    for k in range(1, steps + 1):
        saved = AutoModelForImageTextToText.from_pretrained(out / f"checkpoint-{k}").state_dict()  # module names
        synced = standin.sync(k)
        assert saved.keys() == synced.keys()
        for name, tensor in saved.items():
            assert torch.equal(tensor, synced[name]), (k, name)
        if k > 1:
            assert any(not torch.equal(synced[n], standin.sync(k - 1)[n]) for n in synced)  # the weights moved


@pytest.mark.slow
def test_grpo_through_a_generation_server_pushes_every_step(assets, standin, tmp_path):
    cfg = train_grpo.GRPOConfig(**server_run(assets, standin, tmp_path / "run"))
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    check_pushes(standin, tmp_path / "run", 3)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # each round sampled from the weights the trainer scores with: the log-prob gap is ~0
        assert m["vllm/logp_diff_max"] < 1e-4 and m["grad_norm"] > 0, m
    rounds = standin.requests()
    assert len(rounds) == 3 and all(r["prompts"] == 2 and r["n"] == 4 and r["images"] == [1, 1] for r in rounds)


@pytest.mark.slow
@pytest.mark.full
def test_grpo_server_mode_on_two_processes_with_lora(assets, standin, tmp_path):
    # two processes: the main process gathers both halves of each group into one request and hands them back;
    # LoRA: the server gets the adapted layers merged (the protocol has no adapters), one layer at a time
    args = server_run(assets, standin, tmp_path / "run", per_device_train_batch_size=4, max_steps=2,
                      use_peft="true", lora_r=4, lora_target_modules="q_proj,v_proj")
    del args["vllm_server_host"], args["vllm_server_port"]
    args.update(vllm_server_base_url=standin.url, reward_funcs=args["reward_funcs"][0])
    finish(launch("train_grpo.py", cli(**args), 2, config="cpu"), what="train_grpo.py --vllm_mode server")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["vllm/logp_diff_max"] < 1e-4 for m in metrics)
    assert standin.syncs() == [0, 1, 2]
    rounds = standin.requests()
    assert all(r["prompts"] == 2 and r["n"] == 4 for r in rounds)  # one request for both processes
    first, second = standin.sync(1), standin.sync(2)
    pushed = [n for n in first if "q_proj.weight" in n or "v_proj.weight" in n]
    assert pushed and any(not torch.equal(first[n], second[n]) for n in pushed)  # merged adapters moved them
    frozen = "model.language_model.layers.0.mlp.down_proj.weight"
    assert torch.equal(first[frozen], standin.sync(0)[frozen])  # the base outside LoRA is never sent


@pytest.mark.slow
def test_an_absent_server_stops_the_run_after_the_timeout(assets, tmp_path):
    cfg = train_grpo.GRPOConfig(**server_run(assets, SimpleNamespace(port=free_port()), tmp_path / "run",
                                             vllm_server_timeout=0.5))
    try:
        with pytest.raises(ServerError, match=r"within 0.5 s \(--vllm_server_timeout\)"):
            train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------------------------
# vllm_serve.py over vLLM's engine (a fake `vllm` module: the engine arguments and the payloads)
# ----------------------------------------------------------------------------------------------


def fake_vllm_module(monkeypatch, outputs):
    import types

    built = {}

    class LLM:
        def __init__(self, **kwargs):
            built.update(kwargs)
            self.calls = []

        def generate(self, prompts, params, use_tqdm):
            self.calls.append((prompts, params))
            return outputs

        def collective_rpc(self, method, args=()):
            self.calls.append((method, args))

        def reset_prefix_cache(self):
            self.calls.append(("reset_prefix_cache",))

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kw: SimpleNamespace(**kw)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.StructuredOutputsParams = lambda **kw: ("structured", kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    return built


def test_vllm_serve_builds_the_engine_and_answers_trls_payload(monkeypatch, tmp_path):
    import vllm_serve
    from utils.core.config import parse_config
    from utils.core.vllm_client import encode_image

    lp = lambda value, rank: SimpleNamespace(logprob=value, rank=rank)  # noqa: E731
    outputs = [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[
        SimpleNamespace(token_ids=[5, 6], logprobs=[{5: lp(-0.5, 1)}, {6: lp(float("nan"), 3), 9: lp(-0.1, 1)}]),
        SimpleNamespace(token_ids=[7], logprobs=[{7: lp(-1.0, 2)}])])]
    built = fake_vllm_module(monkeypatch, outputs)
    cfg = parse_config(vllm_serve.ServeConfig, ["--model", "/m", "--tensor_parallel_size", "2", "--max_model_len",
                                                "512", "--mm_processor_kwargs", '{"max_pixels": 3136}',
                                                "--limit_mm_per_prompt", '{"image": 2}', "--enforce_eager"])
    engine = vllm_serve.VLLMEngine(cfg)
    assert built["worker_extension_cls"] == "utils.core.vllm_client.WeightSyncWorkerExtension"
    assert built["logprobs_mode"] == "processed_logprobs" and built["tensor_parallel_size"] == 2
    assert built["mm_processor_kwargs"] == {"max_pixels": 3136} and built["limit_mm_per_prompt"] == {"image": 2}
    assert built["max_model_len"] == 512 and built["enforce_eager"] is True and engine.world_size == 2
    from PIL import Image

    image = Image.new("RGB", (8, 6), (10, 20, 30))
    request = vllm_serve.generate_request({"prompts": [[1, 2]], "images": [[encode_image(image)]], "n": 2,
                                           "temperature": 0.7, "generation_kwargs": {"stop_token_ids": [9]},
                                           "structured_outputs_regex": "[0-9]"})
    out = engine.generate(request)
    (prompts, params), = engine.llm.calls
    assert prompts[0]["prompt_token_ids"] == [1, 2]
    assert prompts[0]["multi_modal_data"]["image"][0].tobytes() == image.tobytes()  # PNG: lossless
    assert (params.n, params.temperature, params.top_k, params.stop_token_ids) == (2, 0.7, -1, [9])
    assert params.structured_outputs == ("structured", {"regex": "[0-9]"})
    assert out["prompt_ids"] == [[1, 2]] and out["completion_ids"] == [[5, 6], [7]]
    assert out["logprobs"] == [[[-0.5], [-0.1, None]], [[-1.0]]]  # by rank, NaN as None (TRL's extract_logprobs)
    assert out["logprob_token_ids"] == [[[5], [9, 6]], [[7]]]
    engine.update_named_param("w", "torch.float32", (2, 2))
    assert engine.llm.calls[-1] == ("update_named_param", ("w", "torch.float32", (2, 2)))
    with pytest.raises(ConfigError, match="--data_parallel_size"):
        vllm_serve.check_config(parse_config(vllm_serve.ServeConfig, ["--model", "/m", "--data_parallel_size", "2"]))
