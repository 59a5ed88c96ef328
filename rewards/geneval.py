"""Client of the GenEval reward server (the flow_grpo / R3 protocol) and the ``geneval`` reward.

Protocol: HTTP POST to the server's base path "/"; the body is a pickle of
``{"images": [JPEG bytes], "meta_datas": [row], "only_strict": bool}``; the reply is a pickle of
``{"scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards"}`` where the first three
are per-image lists and the ``group_*`` entries map a GenEval tag to a per-image list. Training uses
``scores``.

The reply is read with an allow-list unpickler (plain containers, numbers, strings, bytes, numpy arrays):
a reply that names any other global is refused before anything runs, so a compromised or mistaken server
cannot execute code in the trainer.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Sequence
from urllib.parse import urlparse

from rewards.common import GENEVAL_METADATA_KEYS, RewardFunction, check_length, image_bytes, metadata_rows, process_rank
from utils.core.http import post
from utils.core.secrets import redact_url


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle named a global outside the allow-list."""


class RewardServerError(RuntimeError):
    """The reward server could not be reached, failed, or replied with something unusable."""


class RewardServerTimeout(RewardServerError, TimeoutError):
    """The reward server sent no reply within the client's timeout."""


# (module, name) pairs a numpy array or scalar pickle needs, under numpy 1 and numpy 2 module names, plus the
# builtins plain containers use under old protocols. Each only constructs data.
_ALLOWED_GLOBALS = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
    ("builtins", "slice"), ("_codecs", "encode"),  # protocol <= 2 writes bytes as _codecs.encode(str, 'latin1')
    ("__builtin__", "set"), ("__builtin__", "frozenset"), ("__builtin__", "bytearray"),  # protocols 0-1
    ("__builtin__", "complex"), ("__builtin__", "slice"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals in ``_ALLOWED_GLOBALS``."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name}: only plain containers, numbers, "
                                f"strings, bytes and numpy arrays are accepted from a reward server")


def safe_loads(data: bytes) -> Any:
    """``pickle.loads`` restricted to data types; raises UnsafePickleError on anything that could run code."""
    return SafeUnpickler(io.BytesIO(data)).load()


def server_endpoints(urls: str | Sequence[str], ports: str | int | Sequence[int | str] | None = None) -> list[str]:
    """Every ``url:port`` pair of comma-separated ``urls`` x ``ports`` (urls keep their own port when none given).

    >>> server_endpoints("http://a,http://b", "8000,8001")
    ['http://a:8000/', 'http://a:8001/', 'http://b:8000/', 'http://b:8001/']
    """
    url_list = [u.strip() for u in (urls.split(",") if isinstance(urls, str) else urls) if str(u).strip()]
    if isinstance(ports, (str, int)):
        ports = str(ports).split(",")
    port_list = [str(p).strip() for p in (ports or []) if str(p).strip()]
    if not url_list:
        raise ValueError("reward_server_urls is empty: give at least one URL, e.g. http://127.0.0.1")
    for p in port_list:
        if not p.isdigit():
            raise ValueError(f"reward_server_port: {p!r} is not a port number")
    endpoints = []
    for url in url_list:
        if "://" not in url:
            url = "http://" + url
        base = url.rstrip("/")
        if port_list and urlparse(base).port is not None:
            raise ValueError(f"reward server URL {url!r} already has a port; give ports either in the URLs or "
                             f"in reward_server_port, not both")
        for port in port_list or [None]:
            endpoints.append(f"{base}:{port}/" if port else f"{base}/")
    return endpoints


class GenEvalClient:
    """Scores images on a GenEval reward server.

    ``urls``: endpoint URLs (a list or a comma-separated string); this process uses ``urls[rank % n]`` with
    ``rank`` defaulting to the process rank, so ranks spread over servers. Requests go out in batches of
    ``batch_size`` through `utils.core.http.post`: connection errors and 5xx replies are retried ``max_retries``
    times with exponential backoff (``backoff`` * 2^attempt seconds), within ``deadline`` seconds in all (None: no
    bound beyond the attempts'). ``timeout`` bounds each request's wall clock, the reply's bytes included; a server
    that does not answer within it raises RewardServerTimeout without a retry (it is alive but busy, and a retry
    would queue the same work again).
    """

    def __init__(self, urls: str | Sequence[str], *, timeout: float = 60.0, max_retries: int = 3,
                 batch_size: int = 64, rank: int | None = None, backoff: float = 0.5, deadline: float | None = None):
        self.urls = server_endpoints(urls)
        self.rank = process_rank() if rank is None else int(rank)
        self.url = self.urls[self.rank % len(self.urls)]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.timeout, self.max_retries, self.batch_size, self.backoff = timeout, max_retries, batch_size, backoff
        self.deadline = deadline

    def score(self, images: Sequence[Any], metadata: Sequence[dict], only_strict: bool = False) -> dict:
        """Score PIL images (or JPEG bytes) against their GenEval metadata rows, one row per image.

        Returns the server's dict with every per-image list in input order across batches; ``group_*``
        dicts are merged per tag the same way.
        """
        if len(images) != len(metadata):
            raise ValueError(f"GenEvalClient.score: {len(images)} images but {len(metadata)} metadata rows")
        merged: dict[str, Any] = {}
        for start in range(0, len(images), self.batch_size):
            stop = min(start + self.batch_size, len(images))
            payload = {"images": [image_bytes(im) for im in images[start:stop]],
                       "meta_datas": [dict(m) for m in metadata[start:stop]], "only_strict": bool(only_strict)}
            reply = self._post(pickle.dumps(payload), stop - start)
            _merge_into(merged, reply, n_before=start, n_batch=stop - start)
        return merged

    def _post(self, body: bytes, n: int) -> dict:
        response = post(self.url, what="GenEval server", data=body, timeout=self.timeout,
                        max_retries=self.max_retries, backoff=self.backoff, deadline=self.deadline,
                        retry_timeouts=False, failure=RewardServerError, timeout_error=RewardServerTimeout,
                        headers={"Content-Type": "application/octet-stream"})
        if response.status != 200:
            raise RewardServerError(f"GenEval server {redact_url(self.url)} answered HTTP {response.status}: "
                                    f"{response.text[-500:]}")
        return self._decode(response.content, n)

    def _decode(self, content: bytes, n: int) -> dict:
        try:
            reply = safe_loads(content)
        except UnsafePickleError as e:
            raise UnsafePickleError(f"GenEval server {redact_url(self.url)}: {e}") from None
        except Exception as e:
            raise RewardServerError(f"GenEval server {redact_url(self.url)} replied with an unreadable pickle: "
                                    f"{e}") from e
        if not isinstance(reply, dict) or "scores" not in reply:
            raise RewardServerError(f"GenEval server {redact_url(self.url)} replied without 'scores': got "
                                    f"{type(reply).__name__} {sorted(reply) if isinstance(reply, dict) else ''}")
        if len(reply["scores"]) != n:
            raise RewardServerError(f"GenEval server {redact_url(self.url)} returned {len(reply['scores'])} scores "
                                    f"for {n} images")
        return reply


def _merge_into(merged: dict, reply: dict, n_before: int, n_batch: int) -> None:
    """Append one batch's reply: per-image lists concatenate; dicts of per-image lists concatenate per key.

    An entry missing from some batch is padded with None so every list stays aligned with the input.
    """
    n_after = n_before + n_batch
    for key, value in reply.items():
        if isinstance(value, dict):
            groups = merged.setdefault(key, {})
            for tag, per_image in value.items():
                groups.setdefault(tag, [None] * n_before).extend(list(per_image))
        elif hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
            merged.setdefault(key, [None] * n_before).extend(list(value))
        else:
            merged[key] = value
    for value in merged.values():
        for per_image in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(per_image, list):
                per_image.extend([None] * (n_after - len(per_image)))


def geneval_reward(reward_server_urls: str | Sequence[str] = "http://127.0.0.1",
                   reward_server_port: str | int | Sequence[int] | None = "8000", rank: int | None = None,
                   timeout: float = 60.0, max_retries: int = 3, batch_size: int = 64, only_strict: bool = False,
                   metadata_keys: Sequence[str] = GENEVAL_METADATA_KEYS, backoff: float = 0.5,
                   deadline: float | None = None):
    """GenEval server score per generated image: ``fn(completions, images=[PIL, ...], tag=..., include=...)``.

    The trainer passes the generated images as ``images`` (one per completion, None to skip a sample) beside
    the GenEval row columns ``tag``, ``include``, ``exclude``, ``prompt`` (or one ``metadata`` column of
    dicts). Endpoint: ``rank % n`` over ``reward_server_urls`` x ``reward_server_port``. ``timeout``, ``max_retries``,
    ``backoff`` and ``deadline``: as in `GenEvalClient`.
    """
    client = GenEvalClient(server_endpoints(reward_server_urls, reward_server_port), timeout=timeout,
                           max_retries=max_retries, batch_size=batch_size, rank=rank, backoff=backoff,
                           deadline=deadline)
    return RewardFunction("geneval", _geneval, client=client, only_strict=bool(only_strict),
                          metadata_keys=tuple(metadata_keys))


def _geneval(completions, images=None, *, client, only_strict, metadata_keys, **columns) -> list[float | None]:
    n = len(completions)
    if images is None:
        raise ValueError("reward 'geneval' scores images: call it with images=[one PIL image per completion]")
    images = check_length(images, "images", n, "geneval")
    rows = metadata_rows(columns, n, metadata_keys)
    keep = [i for i, im in enumerate(images) if im is not None]
    out: list[float | None] = [None] * n
    if keep:
        reply = client.score([images[i] for i in keep], [rows[i] for i in keep], only_strict=only_strict)
        for i, score in zip(keep, reply["scores"]):
            out[i] = float(score)
    return out


# ---- GenEval++: R3's VLM judge reads the same metadata rows (rewards/judge.py sends the request) ----

# R3's GenEval++ judge (its train/reward_func.py): a system prompt of strict rules, and a user turn with the
# instruction and the checklist built from the row's GenEval metadata (`geneval_plus_checklist`).
GENEVAL_PLUS_SYSTEM = """You are an expert image evaluator.

Your task is to determine whether the given image faithfully satisfies the visual instruction and the expectation \
checklist.

Follow these rules strictly:
1. The image must match **all** expectations, including:
   - Object classes
   - Counts of each object
   - Colors of each object
   - Spatial position within the image (e.g., "above", "below", based on real pixel position)
   - Size and relative scale of objects
2. The image must appear as a **natural, coherent, photo-like single image**.
   - Do NOT allow stylized images (e.g., cartoons, sketches, anime).
   - Do NOT allow collage-style or multi-panel images. Only one consistent, realistic scene is acceptable.
3. Be very strict and conservative in your judgment.

Return your result as a JSON object using this format:
{
  "correct": 1 if the image fully satisfies all expectations, else 0,
}
"""
GENEVAL_PLUS_PROMPT = "Instruction: {prompt}\n\nExplanation: {checklist}"


def geneval_plus_checklist(include: Sequence[dict], exclude: Sequence[dict] | None = None) -> str:
    """R3's checklist of a GenEval row: one line per include item ("{color}-colored {size} {count} {class}s
    located in the {region} part of the image", the missing attributes left out) and per exclude item ("No more
    than {count - 1} {class}s should appear.")."""
    def plural(name, count):
        return name + "s" if count > 1 else name

    lines = []
    for item in include:
        count = item.get("count", 1)
        noun = " ".join([*([f"{item['color']}-colored"] if item.get("color") else []),
                         *([item["size"]] if item.get("size") else []), f"{count} {plural(item['class'], count)}"])
        where = f"located in the {item['region']} part of the image" if item.get("region") else "present in the image"
        lines.append(f"- {noun} {where}.")
    for item in exclude or []:
        count = item.get("count", 1)
        lines.append(f"- No more than {count - 1} {plural(item['class'], count)} should appear.")
    return "This image should contain:\n" + "\n".join(lines)
