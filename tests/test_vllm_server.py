"""--vllm_mode server on the CPU: utils/core/vllm_client.py and vllm_serve_client.py against
tests/vllm_standin_server.py, a real process on 127.0.0.1 that speaks either protocol (vLLM's `vllm serve`, which TRL
1.16's `trl vllm-serve` runs, or the older `trl vllm-serve` one that vllm_serve.py serves) over transformers and joins
the weight-update group over gloo. The protocols (payloads, errors, the command order, a `vllm serve` missing a
setting), how a round's prompts become requests, the flags' refusals, and GRPO runs whose weight pushes are checked:
after every optimizer step the server's weights equal the trainer's checkpoint, and every round samples from the
weights the trainer scores with."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import requests
import torch
from safetensors.torch import load_file

import train_grpo
from tests.grpo_helpers import shapes_assets
from tests.launch_helpers import REPO, cli, finish, free_port, fresh_accelerate_state, launch
from tests.vllm_standin_server import BadRequest, HFEngine, VLLMServeStandIn, check_request
from tiny.shapes import make_shapes_vqa
from utils.core.config import ConfigError
from utils.core.encoding import encode_prompts
from utils.core.models import image_token_id, load_model_and_processor
from utils.core.prompts import build_messages
from utils.core.rollout import special_token_ids_to_suppress, stop_token_ids
from utils.core.tracking import read_jsonl
from utils.core.vllm_client import (
    ServerError,
    VLLMClient,
    group_requests,
    prompt_runs,
    round_sampling,
    sampled_logprobs,
    server_base_url,
    trl_generate_kwargs,
)
from utils.core.vllm_flags import check_vllm_flags
from utils.core.vllm_rollout import pack_completions, prompt_token_ids
from utils.core.vllm_serve_client import (
    VLLMServeClient,
    choice_logprobs,
    completion_body,
    generate_body,
    place_features,
    vllm_sampling_params,
)
from utils.core.vllm_server_rollout import VLLMServerRollout, connect


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shapes_assets(tmp_path_factory, "tests/test_vllm_server.py", 32)


class StandIn:
    """tests/vllm_standin_server.py as a process on 127.0.0.1 (its own session, killed at the end)."""

    def __init__(self, model, dump_dir, *args):
        self.port, self.dump_dir = free_port(), str(dump_dir)
        self.log = open(os.path.join(self.dump_dir + ".log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", "vllm_standin_server.py"), "--model", model,
             "--port", str(self.port), "--dump_dir", self.dump_dir, *args],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        return connect(self.url, group_port=free_port(), connection_timeout=120.0, **kw)

    def requests(self):
        return read_jsonl(os.path.join(self.dump_dir, "requests.jsonl"))

    def events(self):
        return read_jsonl(os.path.join(self.dump_dir, "events.jsonl"))

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
def standin(assets, tmp_path):  # the older `trl vllm-serve` protocol
    server = StandIn(assets["qwen"], tmp_path / "server")
    yield server
    server.stop()


@pytest.fixture
def vllm_standin(assets, tmp_path):  # vLLM's `vllm serve`
    server = StandIn(assets["qwen"], tmp_path / "server", "--protocol", "vllm")
    yield server
    server.stop()


@contextmanager
def serving(engine, **settings):
    """A `vllm serve` stand-in over `engine`, in this process (its engine in a thread of its own): the URL."""
    server = VLLMServeStandIn(engine, "127.0.0.1", 0, model_name="tiny", **settings)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.shutdown()
        server.httpd.server_close()
        thread.join(timeout=30)


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
    model, processor = load_model_and_processor(assets["qwen"])
    tok = processor.tokenizer
    client = standin.client()
    assert isinstance(client, VLLMClient) and client.protocol == "trl" and client.world_size() == 1
    ids, images = prompts(model, processor)
    stop = stop_token_ids(model, tok)
    suppress = special_token_ids_to_suppress(tok, stop)
    cfg = SimpleNamespace(temperature=0.9, top_p=1.0, top_k=None, max_completion_length=6)
    out = client.generate(ids, images, n=3, **trl_generate_kwargs(round_sampling(
        cfg, stop_ids=stop, suppress_ids=suppress, vocab_size=model.config.text_config.vocab_size)))
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
        connect(f"http://127.0.0.1:{free_port()}", connection_timeout=0.5)


# ----------------------------------------------------------------------------------------------
# vLLM's `vllm serve` (TRL 1.16's `trl vllm-serve`) against the stand-in
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_vllm_serve_generate_and_weight_updates(assets, vllm_standin):
    model, processor = load_model_and_processor(assets["qwen"])
    tok = processor.tokenizer
    client = vllm_standin.client()  # told apart by /v1/models
    assert isinstance(client, VLLMServeClient) and client.protocol == "vllm" and client.sends_frozen
    assert (client.model, client.backend, client.logprobs_mode, client.workers) == (
        assets["qwen"], "gloo", "processed_logprobs", 1)
    ids, images = prompts(model, processor)
    stop = stop_token_ids(model, tok)
    suppress = special_token_ids_to_suppress(tok, stop)
    cfg = SimpleNamespace(temperature=0.9, top_p=1.0, top_k=None, max_completion_length=6)
    sampling = round_sampling(cfg, stop_ids=stop, suppress_ids=suppress, vocab_size=model.config.text_config.vocab_size)
    text = ids[1][:7]  # a text prompt: /v1/completions
    entries = [(ids[0], images[0], 11)] * 3 + [(text, [], 22)] * 2 + [(ids[1], images[1], 33)] * 2
    echoed, rows, logps = client.sample(entries, sampling, image_token_id=image_token_id(processor))
    assert echoed == [e[0] for e in entries] and len(rows) == len(logps) == 7
    for row, lp in zip(rows, logps):
        assert 1 <= len(row) <= 6 and len(lp) == len(row) and all(x < 0 for x in lp)
        assert not set(row) & set(suppress) and (len(row) == 6 or row[-1] in stop)
    assert len({tuple(r) for r in rows[:3]}) > 1  # a prompt's n completions differ (seed + k each)
    again = client.sample(entries[:3], sampling, image_token_id=image_token_id(processor))
    assert again[1] == rows[:3]  # seeded: the same seed gives the same completions
    reqs = sorted(vllm_standin.requests()[:3], key=lambda r: r["seed"])  # sent at once: any order
    assert [(r["path"], r["n"], r["seed"], r["images"]) for r in reqs] == [
        ("inference/v1/generate", 3, 11, [1]), ("v1/completions", 2, 22, [0]), ("inference/v1/generate", 2, 33, [1])]
    assert all(r["temperature"] == 0.9 and r["max_tokens"] == 6 and r["stop_token_ids"] == sorted(stop) and
               r["suppressed"] == len(suppress) for r in reqs)

    # weights: the trainer is rank 0 of the group; one update announces every tensor, then broadcasts them in order
    client.init_weight_sync("cpu")
    params = dict(model.named_parameters())
    meta = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params.items()]
    new = {n: torch.randn_like(p) for n, p in params.items()}
    client.push_weights(meta, ((n, new[n]) for n, _, _ in meta))
    (k,) = vllm_standin.syncs()
    synced = vllm_standin.sync(k)
    assert all(torch.equal(synced[n], new[n]) for n in params)
    events = [e["event"] for e in vllm_standin.events() if "/" not in e["event"]]  # generation requests left out
    assert events == ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                      "reset_prefix_cache"]
    (init,) = [e for e in vllm_standin.events() if e["event"] == "init_weight_transfer_engine"]
    assert (init["master_address"], init["rank_offset"], init["world_size"]) == ("127.0.0.1", 1, 2)
    # an update the server cannot load is reported with its name once every tensor went out (nothing is left hanging)
    # (a weight call is sent once: no retry after a 5xx, its broadcasts met exactly one request)
    with pytest.raises(ServerError, match="update_weights failed after 1 attempts .*HTTP 500: .*no parameter "
                                          "'no.such.weight'"):
        client.push_weights([("no.such.weight", "float32", [2])], iter([("no.such.weight", torch.zeros(2))]))
    client._request("POST", "finish_weight_update", {})  # close the refused update, as a restarted trainer would
    name = "model.language_model.norm.weight"
    client.push_weights([(name, "float32", list(params[name].shape))], iter([(name, torch.full_like(params[name], 2))]))
    assert vllm_standin.sync(vllm_standin.syncs()[-1])[name].eq(2).all()  # the group still works
    # an announcement the server refuses at once (a dtype name vLLM's engine cannot read) is raised before any
    # broadcast: the trainer is not left waiting on a group nobody receives from
    with pytest.raises(ServerError, match="update_weights answered 400: .*not torch dtype names"):
        client.push_weights([(name, "torch.float32", list(params[name].shape))], iter([(name, params[name].data)]))
    client._request("POST", "finish_weight_update", {})
    with pytest.raises(RuntimeError, match="not the announced tensor 0 of 1"):  # the trainer checks its own order
        client.push_weights([(name, "float32", [1])], iter([("other", torch.zeros(1))]))


@pytest.fixture(scope="module")
def engine(assets):
    return HFEngine(assets["qwen"])


@pytest.mark.slow
@pytest.mark.parametrize("settings, message", [
    (dict(dev_mode=False), "GET /server_info is not served: restart it with VLLM_SERVER_DEV_MODE=1"),
    (dict(weight_transfer="none"), re.escape("""no weight-transfer engine: restart it with --weight-transfer-config """
                                             """'{"backend": "nccl"}'""")),
    (dict(weight_transfer="nccl"), "backend is 'nccl' and a trainer on cpu needs 'gloo': run the trainer's main "
                                   "process on a GPU"),
])
def test_vllm_serve_missing_a_setting_names_the_restart(assets, engine, settings, message):
    cfg = train_grpo.GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=10.0)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, device=torch.device("cpu"))
    with serving(engine, **settings) as url:
        cfg.vllm_server_base_url, cfg.vllm_group_port = url, free_port()
        with pytest.raises(ServerError, match=message) as err:
            VLLMServerRollout(accelerator, cfg, model_config=engine.model.config, processor=engine.processor)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_vllm_serve_logprobs_mode_scale_out_and_pixel_budget(assets, engine):
    model, processor = engine.model, engine.processor
    cfg = train_grpo.GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=10.0, max_completion_length=4)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, device=torch.device("cpu"),
                                  wait_for_everyone=lambda: None)
    engine.logprobs_mode = "raw_logprobs"
    try:
        with serving(engine) as url:
            cfg.vllm_server_base_url, cfg.vllm_group_port = url, free_port()
            with pytest.raises(ServerError, match="returns raw_logprobs.*restart it with --logprobs-mode "
                                                  "processed_logprobs"):
                VLLMServerRollout(accelerator, cfg, model_config=model.config, processor=processor)
    finally:
        engine.logprobs_mode = "processed_logprobs"
    ids, images = prompts(model, processor)
    sampling = round_sampling(cfg, stop_ids=[0], suppress_ids=[], vocab_size=model.config.text_config.vocab_size)
    with serving(engine, scale_out=False) as url:  # text prompts need no scale-out; image prompts do
        client = connect(url, connection_timeout=10.0)
        assert len(client.sample([(ids[0][:5], [], 1)], sampling)[1]) == 1
        with pytest.raises(ServerError, match="render is not served: restart it with --enable-scale-out"):
            client.sample([(ids[0], images[0], 1)], sampling, image_token_id=image_token_id(processor))
    small = HFEngine(assets["qwen"], max_pixels=3136)  # a server whose image processor has another pixel budget
    with serving(small) as url:
        with pytest.raises(ServerError, match=r"turned the images of prompt 0 into \[4\] placeholder tokens where the "
                                              r"trainer's prompt has runs of \[9\]: .*--mm-processor-kwargs"):
            connect(url, connection_timeout=10.0).sample([(ids[0], images[0], 1)], sampling,
                                                         image_token_id=image_token_id(processor))


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
    sampling = round_sampling(cfg, stop_ids=[9, 4], suppress_ids=[1, 7], vocab_size=10)
    kw = trl_generate_kwargs(sampling)  # the older protocol: one SamplingParams for the round
    assert kw["generation_kwargs"] == {"stop_token_ids": [4, 9], "allowed_token_ids": [0, 2, 3, 4, 5, 6, 8, 9]}
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["max_tokens"], kw["logprobs"]) == (0.7, 0.9, 0, 12, 0)
    json.dumps(kw, allow_nan=False)  # plain JSON: no -inf, no integer keys
    assert "allowed_token_ids" not in trl_generate_kwargs(round_sampling(
        cfg, stop_ids=[9], suppress_ids=[], vocab_size=10))["generation_kwargs"]
    # vllm serve: per prompt, n completions from a seed (vLLM's own 31-bit range), suppressed ids by logit bias
    params = vllm_sampling_params(sampling, n=4, seed=(1 << 40) + 5)
    assert params["logit_bias"] == {"1": -100.0, "7": -100.0} and params["stop_token_ids"] == [4, 9]
    assert (params["n"], params["seed"], params["logprobs"], params["max_tokens"]) == (4, 5, 0, 12)
    assert (params["temperature"], params["top_p"], params["top_k"]) == (0.7, 0.9, 0)
    json.dumps(params, allow_nan=False)
    assert server_base_url(None, "10.0.0.7", 8001) == "http://10.0.0.7:8001"
    assert server_base_url("http://gen:9000/", "ignored", 1) == "http://gen:9000"


def test_vllm_serve_requests_and_replies():
    a, b = [1, 2], [3]
    # one request per run of a prompt's completions, seeded with the run's first seed
    assert prompt_runs([(a, ["x"], 5), (a, ["x"], 6), (b, [], 7), (a, ["x"], 8)]) == [
        [a, ["x"], 2, 0], [b, [], 1, 2], [a, ["x"], 1, 3]]
    # the sampled tokens' log-probs of both reply shapes; a missing one is NaN
    assert choice_logprobs({"logprobs": {"token_logprobs": [-0.5, None], "tokens": ["token_id:3", "token_id:4"]}})[
        0] == -0.5
    assert math.isnan(choice_logprobs({"logprobs": {"token_logprobs": [-0.5, None]}})[1])
    assert choice_logprobs({"logprobs": {"content": [{"token": "token_id:3", "logprob": -0.25}]}}) == [-0.25]
    assert choice_logprobs({"logprobs": None}) is None
    # the server's placeholders (in its own rendering of the images) move onto the trainer's runs of image tokens
    features = {"mm_hashes": {"image": ["h0", "h1"]}, "kwargs_data": {"image": ["d0", "d1"]},
                "mm_placeholders": {"image": [{"offset": 2, "length": 3}, {"offset": 8, "length": 2}]}}
    ids = [5, 9, 9, 9, 6, 7, 9, 9, 8]
    placed = place_features(features, ids, 9)
    assert placed["mm_placeholders"]["image"] == [{"offset": 1, "length": 3}, {"offset": 6, "length": 2}]
    assert placed["kwargs_data"] == features["kwargs_data"] and placed["mm_hashes"] == features["mm_hashes"]
    with pytest.raises(ServerError, match=r"prompt 4 into \[3, 2\] placeholder tokens where the trainer's prompt has "
                                          r"runs of \[3, 1\]: .*--mm-processor-kwargs"):
        place_features(features, [5, 9, 9, 9, 6, 9], 9, prompt=4)


def test_vllm_serve_bodies_are_what_vllm_takes():
    # the stand-in refuses what vLLM's request models would not take, a field vLLM would drop, and sampling left to
    # the model's generation config: our bodies pass, each broken one is refused naming the field
    cfg = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=None, max_completion_length=12)
    params = vllm_sampling_params(round_sampling(cfg, stop_ids=[9], suppress_ids=[1], vocab_size=10), n=2, seed=3)
    body = completion_body("m", [5, 6], params)
    assert body["prompt"] == [[5, 6]] and body["return_token_ids"] is True  # TRL's form: a list of prompts
    check_request("v1/completions", body)
    features = {"mm_hashes": {"image": ["h"]}, "kwargs_data": {"image": ["d"]},
                "mm_placeholders": {"image": [{"offset": 1, "length": 1}]}}
    generate = generate_body("m", [5, 7], features, params)
    assert generate["sampling_params"]["output_kind"] == 2 and generate["token_ids"] == [5, 7]
    check_request("inference/v1/generate", generate)
    info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    check_request("update_weights", {"update_info": info})
    check_request("init_weight_transfer_engine", {"init_info": dict(master_address="127.0.0.1", master_port=1,
                                                                    rank_offset=1, world_size=2)})
    check_request("start_weight_update", {})
    refused = [
        ("v1/completions", {**body, "temprature": 0.7}, r"unknown fields \['temprature'\]"),
        ("v1/completions", {k: v for k, v in body.items() if k != "top_k"}, r"missing fields \['top_k'\]"),
        ("v1/completions", {**body, "prompt": [5, 6]}, "a list of lists"),
        ("v1/completions", {**body, "logit_bias": {1: -100.0}}, "logit_bias maps token ids"),
        ("inference/v1/generate", {**generate, "sampling_params": {**params, "stop_ids": [9]}},
         r"sampling_params: unknown fields \['stop_ids'\]"),
        ("update_weights", {"update_info": {**info, "dtype_names": ["torch.float32"]}}, "not torch dtype names"),
        ("update_weights", {"update_info": {**info, "shapes": []}}, "different lengths"),
        ("update_weights", {"update_info": {**info, "packed": True}}, "packed transfers"),
        ("update_weights", info, r"unknown fields \['dtype_names', 'names', 'shapes'\]"),
        ("init_weight_transfer_engine", {"init_info": {"host": "x", "port": 1}}, "init_info: unknown fields"),
        ("init_weight_transfer_engine", {"init_info": dict(master_address="127.0.0.1", master_port=1, world_size=2)},
         r"init_info: missing fields \['rank_offset'\]"),
        ("start_weight_update", {"is_checkpoint": True}, "unknown fields"),
    ]
    for route, broken, message in refused:
        with pytest.raises(BadRequest, match=message):
            check_request(route, broken)


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
    base = dict(model_name_or_path=assets["qwen"], dataset_name=assets["data"], output_dir=str(out),
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


def grpo_in_process(assets, server, out):
    """3 GRPO steps against `server` in this process: every push and round checked (`check_pushes`, a gap of ~0)."""
    cfg = train_grpo.GRPOConfig(**server_run(assets, server, out))
    try:
        train_grpo.main(cfg)
    finally:
        fresh_accelerate_state()
    check_pushes(server, out, 3)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # each round sampled from the weights the trainer scores with: the log-prob gap is ~0
        assert m["vllm/logp_diff_max"] < 1e-4 and m["grad_norm"] > 0, m


def lora_launch(assets, server, out):
    """2 GRPO steps with LoRA on two launched processes against `server`: the pushes after each step (sync 1, 2)."""
    args = server_run(assets, server, out, per_device_train_batch_size=4, max_steps=2, use_peft="true", lora_r=4,
                      lora_target_modules="q_proj,v_proj")
    del args["vllm_server_host"], args["vllm_server_port"]
    args.update(vllm_server_base_url=server.url, reward_funcs=args["reward_funcs"][0])
    finish(launch("train_grpo.py", cli(**args), 2, config="cpu"), what="train_grpo.py --vllm_mode server")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["vllm/logp_diff_max"] < 1e-4 for m in metrics)
    assert server.syncs() == [0, 1, 2]
    first, second = server.sync(1), server.sync(2)
    pushed = [n for n in first if "q_proj.weight" in n or "v_proj.weight" in n]
    assert pushed and any(not torch.equal(first[n], second[n]) for n in pushed)  # merged adapters moved them
    return first


@pytest.mark.slow
def test_grpo_through_vllm_serve_pushes_every_weight_every_step(assets, vllm_standin, tmp_path):
    from transformers import AutoModelForImageTextToText

    grpo_in_process(assets, vllm_standin, tmp_path / "run")
    # the group formed once; every update (before the first round, then after each step) came before the next round
    events = vllm_standin.events()
    update = ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]
    generate = ["inference/v1/generate"] * 2  # one request per prompt, its 4 completions together
    assert [e["event"] for e in events] == ["init_weight_transfer_engine"] + (update + generate) * 3 + update
    names = {n for n, _ in AutoModelForImageTextToText.from_pretrained(assets["qwen"]).named_parameters()}
    for e in events:  # every weight, frozen or not, as vLLM reloads whole layers (and TRL sends)
        assert e["event"] != "update_weights" or sorted(e["names"]) == sorted(names)
    rounds = vllm_standin.requests()
    assert len(rounds) == 6 and all(r["n"] == 4 and r["images"] == [1] for r in rounds)
    assert len({r["seed"] for r in rounds}) == 6  # each prompt's completions from the trainer's seeds


@pytest.mark.slow
@pytest.mark.full
def test_grpo_through_a_generation_server_pushes_every_step(assets, standin, tmp_path):
    grpo_in_process(assets, standin, tmp_path / "run")  # the older protocol
    rounds = standin.requests()
    assert len(rounds) == 3 and all(r["prompts"] == 2 and r["n"] == 4 and r["images"] == [1, 1] for r in rounds)


@pytest.mark.slow
@pytest.mark.full
def test_grpo_server_mode_on_two_processes_with_lora(assets, standin, tmp_path):
    # two processes: the main process gathers both halves of each group into one request and hands them back;
    # LoRA: the server gets the adapted layers merged (the protocol has no adapters), one layer at a time
    first = lora_launch(assets, standin, tmp_path / "run")
    rounds = standin.requests()
    assert all(r["prompts"] == 2 and r["n"] == 4 for r in rounds)  # one request for both processes
    frozen = "model.language_model.layers.0.mlp.down_proj.weight"
    assert torch.equal(first[frozen], standin.sync(0)[frozen])  # the base outside LoRA is never sent


@pytest.mark.slow
@pytest.mark.full
def test_grpo_through_vllm_serve_on_two_processes_with_lora(assets, vllm_standin, tmp_path):
    # the main process asks for both processes' halves of each group at once; every weight is pushed, the adapted
    # layers merged (vLLM's update takes checkpoint weights), the rest as loaded
    first = lora_launch(assets, vllm_standin, tmp_path / "run")
    rounds = vllm_standin.requests()
    assert len(rounds) == 4 and all(r["n"] == 4 for r in rounds)  # 2 prompts a round, each asked for once
    updates = [e["names"] for e in vllm_standin.events() if e["event"] == "update_weights"]
    frozen = "model.language_model.layers.0.mlp.down_proj.weight"
    assert len(updates) == 3 and all(frozen in names and not any("lora" in n for n in names) for names in updates)
    assert torch.equal(first[frozen], vllm_standin.sync(0)[frozen])  # sent as it was loaded


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
    assert built["worker_extension_cls"] == "utils.core.vllm_group.WeightSyncWorkerExtension"
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
