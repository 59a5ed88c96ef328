"""Reward-server clients against loopback servers started here: the GenEval pickle protocol and an
OpenAI-compatible judge. Only 127.0.0.1; timeouts are tiny so the failure paths stay fast."""

import base64
import io
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from rewards import get_reward
from rewards.geneval import GenEvalClient, RewardServerError, UnsafePickleError, safe_loads, server_endpoints
from rewards.judge import JudgeClient, JudgeError, extract_json, tiif_answers

# --- loopback server harness -------------------------------------------------------------------------------

class Loopback:
    """A threaded HTTP server on 127.0.0.1:<free port> whose POST handler is ``respond(state, path, body)``."""

    def __init__(self, respond):
        self.respond = respond
        self.requests = []          # (path, body) in arrival order
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    outer.requests.append((self.path, body, dict(self.headers)))
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                    attempt = len(outer.requests)
                try:
                    status, payload = outer.respond(attempt, self.path, body)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(respond):
        servers.append(Loopback(respond))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _image(color, size=32):
    return Image.new("RGB", (size, size), color)


# --- a GenEval server that implements the protocol ---------------------------------------------------------

def geneval_reply(body):
    """Score = the number in the row's prompt "p<k>" / 100, so order is checkable; checks the request too."""
    request = pickle.loads(body)  # the server trusts its clients; the client is what we test
    assert set(request) == {"images", "meta_datas", "only_strict"}
    sizes = [Image.open(io.BytesIO(b), formats=["jpeg"]).size for b in request["images"]]
    assert len(sizes) == len(request["meta_datas"])
    scores = [int(m["prompt"][1:]) / 100 for m in request["meta_datas"]]
    strict = [float(request["only_strict"])] * len(scores)
    reply = {"scores": np.asarray(scores), "rewards": scores, "strict_rewards": strict,
             "group_rewards": {"counting": [s if m["tag"] == "counting" else -10.0
                                            for s, m in zip(scores, request["meta_datas"])]},
             "group_strict_rewards": {"counting": strict}}
    return 200, pickle.dumps(reply)


class Boom:
    """Unpickling this runs os.system (or writes a file): what a hostile server could send."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class OpenBoom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').write('pwned')",)


def _meta(ids, tag="counting"):
    return [{"tag": tag, "include": [{"class": "circle", "count": 1}], "exclude": [], "prompt": f"p{i}"}
            for i in ids]


def test_geneval_success_batches_in_order(serve):
    server = serve(lambda attempt, path, body: geneval_reply(body))
    client = GenEvalClient([server.url], batch_size=3, timeout=5.0)
    images = [_image((10 * i, 0, 0)) for i in range(7)]
    out = client.score(images, _meta(range(7)), only_strict=True)
    assert [r[0] for r in server.requests] == ["/"] * 3  # POST to the base path, 3 + 3 + 1
    assert [len(pickle.loads(r[1])["images"]) for r in server.requests] == [3, 3, 1]
    assert out["scores"] == pytest.approx([i / 100 for i in range(7)])
    assert out["strict_rewards"] == [1.0] * 7
    assert out["group_rewards"]["counting"] == pytest.approx([i / 100 for i in range(7)])


def test_geneval_retries_a_500_then_succeeds(serve):
    def respond(attempt, path, body):
        return (500, b"Traceback: CUDA OOM") if attempt == 1 else geneval_reply(body)

    server = serve(respond)
    client = GenEvalClient(server.url, timeout=5.0, max_retries=2, backoff=0.01)
    out = client.score([_image("red")] * 2, _meta([5, 6]))
    assert len(server.requests) == 2
    assert out["scores"] == pytest.approx([0.05, 0.06])


def test_geneval_gives_up_after_max_retries(serve):
    server = serve(lambda attempt, path, body: (503, b"overloaded"))
    client = GenEvalClient(server.url, timeout=5.0, max_retries=2, backoff=0.01)
    with pytest.raises(RewardServerError, match="3 attempts.*503"):
        client.score([_image("red")], _meta([1]))
    assert len(server.requests) == 3


def test_geneval_slower_than_timeout_raises_fast(serve):
    def respond(attempt, path, body):
        time.sleep(1.5)
        return geneval_reply(body)

    server = serve(respond)
    client = GenEvalClient(server.url, timeout=0.3, max_retries=3, backoff=0.01)
    start = time.monotonic()
    with pytest.raises(RewardServerError, match="timeout=0.3") as error:
        client.score([_image("red")], _meta([1]))
    assert isinstance(error.value, TimeoutError)
    assert time.monotonic() - start < 1.2
    assert len(server.requests) == 1  # a busy server is not sent the same work again


def test_geneval_connection_refused_is_retried_then_clear_error(serve):
    server = serve(lambda attempt, path, body: geneval_reply(body))
    url = server.url
    server.close()  # nothing listens on that port now
    client = GenEvalClient(url, timeout=0.5, max_retries=1, backoff=0.01)
    with pytest.raises(RewardServerError, match="2 attempts.*connection error"):
        client.score([_image("red")], _meta([1]))


@pytest.mark.parametrize("payload_cls", [Boom, OpenBoom])
def test_geneval_malicious_pickle_is_refused_and_not_executed(serve, tmp_path, payload_cls):
    marker = tmp_path / "pwned"
    server = serve(lambda attempt, path, body: (200, pickle.dumps({"scores": [payload_cls(str(marker))]})))
    client = GenEvalClient(server.url, timeout=5.0)
    with pytest.raises(UnsafePickleError, match="refusing to unpickle global"):
        client.score([_image("red")], _meta([1]))
    time.sleep(0.05)
    assert not marker.exists()


def test_safe_loads_accepts_data_and_numpy_under_every_protocol():
    data = {"scores": [0.5, 1], "arr": np.arange(6, dtype=np.float32).reshape(2, 3), "s": {1, 2},
            "f": frozenset({"a"}), "b": b"\x00\xff", "t": (1.5, None, True), "x": np.float64(0.25),
            "c": 1 + 2j, "ba": bytearray(b"ab")}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        out = safe_loads(pickle.dumps(data, protocol=protocol))
        assert out["scores"] == [0.5, 1] and out["s"] == {1, 2} and out["b"] == b"\x00\xff"
        np.testing.assert_array_equal(out["arr"], data["arr"])
        assert out["x"] == 0.25 and out["t"] == (1.5, None, True) and out["c"] == 1 + 2j


def test_safe_loads_refuses_classes_and_callables():
    import collections

    for obj in [collections.OrderedDict(a=1), Image.new("RGB", (2, 2)), print]:
        with pytest.raises(UnsafePickleError):
            safe_loads(pickle.dumps(obj))


def test_server_endpoints_cross_product_and_errors():
    assert server_endpoints("http://a,b", "8000,8001") == [
        "http://a:8000/", "http://a:8001/", "http://b:8000/", "http://b:8001/"]
    assert server_endpoints(["http://h:9/"]) == ["http://h:9/"]
    with pytest.raises(ValueError, match="already has a port"):
        server_endpoints("http://h:9", "8000")
    with pytest.raises(ValueError, match="not a port"):
        server_endpoints("http://h", "80a")
    with pytest.raises(ValueError, match="empty"):
        server_endpoints("", "8000")


def test_geneval_reward_picks_endpoint_by_rank(serve):
    servers = [serve(lambda attempt, path, body: geneval_reply(body)) for _ in range(2)]
    ports = ",".join(str(s.port) for s in servers)
    meta = _meta([3, 4, 9])
    columns = {k: [m[k] for m in meta] for k in ("tag", "include", "exclude", "prompt")}
    for rank, expected in [(0, 0), (1, 1), (3, 1)]:
        before = [len(s.requests) for s in servers]
        fn = get_reward("geneval", reward_server_urls="http://127.0.0.1", reward_server_port=ports, rank=rank,
                        timeout=5.0)
        out = fn(["<think>a</think>"] * 3, images=[_image("red"), None, _image("blue")], question=["q"] * 3,
                 **columns)
        assert out[1] is None and out[0] == pytest.approx(0.03) and out[2] == pytest.approx(0.09)
        assert [len(s.requests) - b for s, b in zip(servers, before)] == [int(expected == 0), int(expected == 1)]
        sent = pickle.loads(servers[expected].requests[-1][1])["meta_datas"]
        assert [m["prompt"] for m in sent] == ["p3", "p9"]  # the None image is not sent
        assert set(sent[0]) == {"tag", "include", "exclude", "prompt"}  # only GenEval's own keys travel


def test_geneval_reward_errors_name_what_is_missing(serve):
    server = serve(lambda attempt, path, body: geneval_reply(body))
    fn = get_reward("geneval", reward_server_urls=server.url, reward_server_port=None, timeout=5.0)
    with pytest.raises(ValueError, match="images="):
        fn(["x"], include=[[]])
    with pytest.raises(ValueError, match="'include'"):
        fn(["x"], images=[_image("red")], question=["q"])
    with pytest.raises(ValueError, match="'tag' has 2 entries for 1"):
        fn(["x"], images=[_image("red")], include=[[]], tag=["a", "b"])


# --- an OpenAI-compatible judge ----------------------------------------------------------------------------

def _decode_request(body):
    request = json.loads(body)
    content = request["messages"][-1]["content"]  # the user turn (after the system turn, when there is one)
    url = next(p["image_url"]["url"] for p in content if p["type"] == "image_url")
    assert url.startswith("data:image/jpeg;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    text = next(p["text"] for p in content if p["type"] == "text")
    return request, image, text


def _is_red(image):
    r, g, b = image.getpixel((image.width // 2, image.height // 2))
    return r > 128 and g < 100 and b < 100


def _chat_reply(text):
    return 200, json.dumps({"id": "x", "object": "chat.completion",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode()


GENEVAL_PLUS_STYLES = [
    lambda ok: '{"reason": "fine", "correct": %s}' % ("true" if ok else "false"),
    lambda ok: "<think>let me look</think>\n```json\n{\"correct\": %s, \"reason\": \"x\"}\n```" % str(ok).lower(),
    lambda ok: "Sure! Here is my verdict: {'reason': 'checked', 'correct': %s} Hope this helps [1]." % ok,
    lambda ok: '{"reason": "trailing comma", "correct": "%s",}' % ("yes" if ok else "no"),
]


def test_judge_geneval_plus_against_loopback_openai_server(serve):
    def respond(attempt, path, body):
        request, image, text = _decode_request(body)
        assert path == "/v1/chat/completions" and request["model"] == "judge-model"
        style = GENEVAL_PLUS_STYLES[int(text.split("#", 1)[1].split()[0]) % len(GENEVAL_PLUS_STYLES)]
        time.sleep(0.1)  # long enough that concurrent requests overlap
        return _chat_reply(style(_is_red(image)))

    server = serve(respond)
    fn = get_reward("judge_geneval_plus", base_url=server.url + "/v1", model="judge-model", api_key="k",
                    max_concurrency=3, timeout=5.0)
    colors = ["red", "blue", "red", "red", "green", "red", "blue", "red"]
    images = [_image(c) for c in colors]
    images[4] = None
    out = fn(["<think>..</think>"] * 8, images=images, prompt=[f"a red square #{i}" for i in range(8)],
             include=[[{"class": "square", "count": 1, "color": "red"}]] * 8)
    assert out == [1.0, 0.0, 1.0, 1.0, None, 1.0, 0.0, 1.0]
    assert len(server.requests) == 7
    assert 1 < server.max_in_flight <= 3  # concurrent, but bounded
    assert server.requests[0][2]["Authorization"] == "Bearer k"


def test_judge_tiif_fraction_of_matching_answers(serve):
    def respond(attempt, path, body):
        _, image, text = _decode_request(body)
        questions = [line.split(". ", 1)[1] for line in text.splitlines() if line[:1].isdigit()]
        answers = ["yes" if ("red" in q) == _is_red(image) else "no" for q in questions]
        if len(questions) == 3:  # another common shape: numbered lines, no JSON
            return _chat_reply("\n".join(f"{k + 1}. {a.capitalize()}" for k, a in enumerate(answers)))
        return _chat_reply(json.dumps({"answers": answers}))

    server = serve(respond)
    fn = get_reward("judge_tiif", base_url=server.url + "/v1", model="m", timeout=5.0)
    questions = [["Is it red?", "Is it blue?"], ["Is it red?", "Is it red and bright?", "Is it blue?"],
                 ["Is it red?"], []]
    expected = [["yes", "no"], ["yes", "yes", "yes"], [True], []]
    out = fn(["c"] * 4, images=[_image("red"), _image("red"), _image("blue"), _image("red")],
             yn_question_list=questions, yn_answer_list=expected)
    # row 0: judge says yes/no -> 2/2; row 1: yes/yes/no -> 2/3; row 2: judge says no vs True -> 0; row 3: none
    assert out[0] == 1.0 and out[1] == pytest.approx(2 / 3) and out[2] == 0.0 and out[3] is None
    assert len(server.requests) == 3
    with pytest.raises(ValueError, match="row 0 has 2 questions.*1 answers"):
        fn(["c"], images=[_image("red")], yn_question_list=[["a", "b"]], yn_answer_list=[["yes"]])


def test_judge_retries_5xx_and_429_then_succeeds(serve):
    def respond(attempt, path, body):
        if attempt == 1:
            return 503, b"loading"
        if attempt == 2:
            return 429, b"slow down"
        return _chat_reply('{"correct": true}')

    server = serve(respond)
    client = JudgeClient(server.url + "/v1", "m", timeout=5.0, max_retries=2, backoff=0.01)
    assert client.chat("hi", _image("red")) == '{"correct": true}'
    assert len(server.requests) == 3


def test_judge_timeout_and_bad_reply_are_clear_errors(serve):
    def slow(attempt, path, body):
        time.sleep(1.0)
        return _chat_reply("late")

    server = serve(slow)
    client = JudgeClient(server.url + "/v1", "m", timeout=0.2, max_retries=1, backoff=0.01)
    start = time.monotonic()
    with pytest.raises(JudgeError, match="2 attempts.*timeout=0.2"):
        client.chat("hi")
    assert time.monotonic() - start < 1.0

    bad = serve(lambda attempt, path, body: (200, b'{"error": "no choices"}'))
    with pytest.raises(JudgeError, match="choices"):
        JudgeClient(bad.url + "/v1", "m", timeout=2.0).chat("hi")
    forbidden = serve(lambda attempt, path, body: (401, b"bad key"))
    with pytest.raises(JudgeError, match="401"):
        JudgeClient(forbidden.url + "/v1", "m", timeout=2.0, max_retries=3).chat("hi")
    assert len(forbidden.requests) == 1  # client errors are not retried


def test_extract_json_and_tiif_answer_shapes():
    assert extract_json('x {"a": 1} y {"a": 2, "b": [1, 2]} z [3]') == {"a": 2, "b": [1, 2]}
    assert extract_json("<think>{\"a\": 0}</think> final: {\"a\": 1}") == {"a": 1}
    assert extract_json("{'a': True, 'b': None}") == {"a": True, "b": None}
    assert extract_json('{"a": [1, 2,],}') == {"a": [1, 2]}
    assert extract_json("no json here") is None
    assert tiif_answers('{"1": "Yes", "2": "no."}', 2) == [True, False]
    assert tiif_answers('["yes"]', 2) == [True, None]
    assert tiif_answers("1) yes\n2) NO\n", 3) == [True, False, None]
    assert tiif_answers('{"answers": ["none", "yes, clearly"]}', 2) == [None, True]


def test_batches_with_uneven_keys_stay_aligned(serve):
    def respond(attempt, path, body):
        status, payload = geneval_reply(body)
        reply = pickle.loads(payload)
        if attempt == 2:  # the second batch carries no strict_rewards and a new group tag
            del reply["strict_rewards"]
            reply["group_rewards"]["colors"] = [0.5] * len(reply["scores"])
        return status, pickle.dumps(reply)

    server = serve(respond)
    out = GenEvalClient(server.url, batch_size=2, timeout=5.0).score(
        [np.zeros((8, 8, 3), dtype=np.uint8)] * 5, _meta(range(5)))  # HWC arrays are accepted too
    assert out["scores"] == pytest.approx([0, 0.01, 0.02, 0.03, 0.04])
    assert out["strict_rewards"] == [0.0, 0.0, None, None, 0.0]
    assert out["group_rewards"]["colors"] == [None, None, 0.5, 0.5, None]


# --- crystal-metrics' LLM grader behind `accuracy` ---------------------------------------------------------

def test_accuracy_llm_grader_that_fails_is_reported_not_string_matched(serve):
    """crystal-metrics' own judge falls back to string matching on any error; our `accuracy` reports it."""
    from rewards.geneval import RewardServerError

    answer = json.dumps({"reasoning_steps": ["The sky looks blue"], "answer": "the colour of the sky at noon"})
    gold = ["a clear blue sky in daylight"]  # free text of several words: the grader is asked
    down = serve(lambda attempt, path, body: (500, b'{"error": "overloaded"}'))
    fn = get_reward("accuracy", use_llm_grader=True, llm_model="judge", base_url=down.url + "/v1")
    with pytest.raises(RewardServerError, match=r"LLM grader 'judge' at http://127.0.0.1:\d+/v1 failed"):
        fn([answer], answer=gold, question=["What colour is the sky?"])
    assert down.requests and down.requests[0][0] == "/v1/chat/completions"

    def verdict(attempt, path, body):
        reply = {"choices": [{"message": {"role": "assistant", "content": '{"correct": true, "confidence": 0.9}'}}]}
        return 200, json.dumps(reply).encode()

    up = serve(verdict)
    ok = get_reward("accuracy", use_llm_grader=True, llm_model="judge", base_url=up.url + "/v1")
    assert ok([answer], answer=gold, question=["What colour is the sky?"]) == [pytest.approx(0.9)]


# --- deadlines, retries and keys on every HTTP call (utils/core/http.py) --------------------------------------------


class Trickle:
    """A server that answers 200 at once, then sends its body one byte every `gap` seconds: every socket read
    succeeds, so a per-read timeout never fires."""

    def __init__(self, gap=0.1, size=10_000):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.gap, self.size, self.stop = gap, size, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        try:
            conn.recv(65536)
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.size}\r\n\r\n".encode())
            for _ in range(self.size):
                if self.stop.is_set():
                    break
                conn.sendall(b" ")
                time.sleep(self.gap)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        self.sock.close()


def test_a_server_trickling_bytes_cannot_stall_a_call_past_its_bounds():
    from utils.core.http import HTTPTimeout, post

    server = Trickle()
    try:
        start = time.monotonic()
        with pytest.raises(JudgeError, match=r"failed after 2 attempts \(timeout=0.5s\).*no whole reply"):
            JudgeClient(server.url + "/v1", "m", timeout=0.5, max_retries=1, backoff=0.01).chat("hi")
        assert time.monotonic() - start < 2.5  # two attempts of 0.5 s, not the 1000 s the bytes would take
        start = time.monotonic()
        with pytest.raises(HTTPTimeout, match="within the deadline of 0.8s"):
            post(server.url, what="server", data=b"x", timeout=0.5, max_retries=5, backoff=0.2, deadline=0.8)
        assert time.monotonic() - start < 1.6
        with pytest.raises(RewardServerError, match="sent no reply within timeout=0.3s"):
            GenEvalClient(server.url, timeout=0.3).score([_image("red")], _meta([1]))
    finally:
        server.close()


def test_an_api_key_goes_only_over_https_or_to_this_machine(serve, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"http://10.1.2.3:8000/v1/chat/completions: refusing to send an API key "
                                         r"over plain http.*--allow_insecure_api_key"):
        JudgeClient("http://10.1.2.3:8000/v1", "m", api_key="sk-1")
    JudgeClient("https://judge.example/v1", "m", api_key="sk-1")
    JudgeClient("http://10.1.2.3:8000/v1", "m")  # no key ("EMPTY", vLLM's default): nothing to leak
    JudgeClient("http://10.1.2.3:8000/v1", "m", api_key="sk-1", allow_insecure_api_key=True)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")  # a key from the environment counts too
    with pytest.raises(ValueError, match="refusing"):
        get_reward("judge_tiif", base_url="http://judge.lan/v1", model="m")
    server = serve(lambda attempt, path, body: _chat_reply('{"correct": 1}'))
    assert JudgeClient(server.url + "/v1", "m").chat("hi") == '{"correct": 1}'  # loopback: fine
    assert server.requests[0][2]["Authorization"] == "Bearer sk-env"
    import evaluate
    import train_mixgrpo
    from utils.core.config import ConfigError
    from utils.core.reward_calls import build_image_reward

    with pytest.raises(ConfigError, match="--reward_fn judge_tiif: .*refusing"):
        build_image_reward(train_mixgrpo.MixGRPOConfig(reward_fn="judge_tiif", dataset_name="tiif",
                                                       reward_server_urls="http://judge.lan"))
    assert build_image_reward(train_mixgrpo.MixGRPOConfig(reward_fn="judge_tiif", dataset_name="tiif",
                                                          reward_server_urls="http://judge.lan",
                                                          allow_insecure_api_key=True)) is not None
    with pytest.raises(ConfigError, match="--allow_insecure_api_key applies to the judge rewards"):
        train_mixgrpo.validate(train_mixgrpo.MixGRPOConfig(allow_insecure_api_key=True, policy_group_size=1), 1)
    assert evaluate.EvalConfig(allow_insecure_api_key=True).allow_insecure_api_key


def test_served_evaluation_retries_a_5xx_and_a_reset(serve):
    from utils.eval.heldout import generate_answers_remote

    def respond(attempt, path, body):
        if attempt == 1:
            return 502, b"bad gateway"
        return _chat_reply("<answer>4</answer>")

    server = serve(respond)
    rows = [{"id": "r0", "question": "2 + 2?", "image": _image("red"), "answer": "4"}]
    assert generate_answers_remote(server.url + "/v1", "m", rows, prompt_template="plain", timeout=5.0,
                                   backoff=0.01) == ["<answer>4</answer>"]
    assert len(server.requests) == 2
    down = serve(lambda attempt, path, body: (503, b"down"))
    with pytest.raises(RuntimeError, match=r"--base_url: row 'r0': judge .* failed after 2 attempts"):
        generate_answers_remote(down.url + "/v1", "m", rows, prompt_template="plain", timeout=5.0, max_retries=1,
                                backoff=0.01)


def test_mixgrpo_image_rewards_are_held_to_grpos_rules():
    from types import SimpleNamespace

    from rewards.judge import tiif_score
    from utils.core.reward_calls import score_images

    cfg = SimpleNamespace(reward_fn="mine:score")
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    images = [_image("red"), _image("blue")]
    with pytest.raises(ValueError, match=r"reward 'mine:score' returned 1 rewards for 2 images"):
        score_images(cfg, lambda texts, images, **c: [1.0], ["t", "t"], images, rows)  # no silent broadcast
    with pytest.raises(ValueError, match=r"reward 'mine:score' returned 3 rewards for 2 images"):
        score_images(cfg, lambda texts, images, **c: [1.0, 0.0, 1.0], ["t", "t"], images, rows)
    scores = score_images(cfg, lambda texts, images, **c: [float("inf"), None], ["t", "t"], images, rows)
    assert scores.isnan().all()  # inf is unscored, as None: never trained on
    assert tiif_score("I cannot tell.", ["yes", "no"]) is None  # no answer read: no score, not 0.0
    assert tiif_score('{"answers": ["yes", "maybe"]}', ["yes", "no"]) == 0.5


def test_evaluate_and_distill_refuse_a_key_over_plain_http_before_anything_loads(monkeypatch):
    import distill
    import evaluate

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--base_url: http://10.0.0.9:8000/v1.*refusing"):
        evaluate.validate(evaluate.EvalConfig(base_url="http://10.0.0.9:8000/v1", served_model_name="m",
                                              api_key="sk-1"))
    evaluate.validate(evaluate.EvalConfig(base_url="http://10.0.0.9:8000/v1", served_model_name="m",
                                          api_key="sk-1", allow_insecure_api_key=True))
    with pytest.raises(ValueError, match="--reasoner_base_url: .*refusing"):
        distill.validate(distill.DistillConfig(reasoner_base_url="http://judge.lan/v1", api_key="sk-1"))
    distill.validate(distill.DistillConfig(reasoner_base_url="https://judge.lan/v1", api_key="sk-1"))
