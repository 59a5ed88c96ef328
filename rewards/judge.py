"""VLM-as-judge rewards over any OpenAI-compatible chat endpoint (e.g. vLLM serving Qwen2.5-VL-72B-AWQ).

The image travels inline as a base64 data URL; requests run in a bounded thread pool, each with a wall-clock
timeout, retries (connection errors, timeouts, 429 and 5xx, exponential backoff) and a deadline
(`utils.core.http`); an API key goes only over https or to 127.0.0.1 unless `allow_insecure_api_key`.
Replies are read with a tolerant JSON extractor: reasoning blocks, code fences, prose around the object,
Python-style literals and trailing commas are all handled.

    judge_geneval_plus  GenEval++ (R3's judge): strict rules as the system prompt, the prompt and a checklist built
                        from the row's include / exclude metadata; the judge returns {"correct": 1|0}; the
                        reward is 1.0 / 0.0, None when the reply holds no verdict
    judge_tiif          TIIF: the judge answers the row's yn_question_list; the reward is the fraction of
                        its answers equal to yn_answer_list
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from rewards.common import RewardFunction, image_bytes, images_column, optional_column, prompt_texts
from rewards.geneval import GENEVAL_PLUS_PROMPT, GENEVAL_PLUS_SYSTEM, geneval_plus_checklist
from utils.core.http import post
from utils.core.secrets import NOT_SECRET, redact_url

DEFAULT_JUDGE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_JUDGE_MODEL = "Qwen/Qwen2.5-VL-72B-Instruct-AWQ"


class JudgeError(RuntimeError):
    """The judge endpoint could not be reached or replied with something that is not a chat completion."""


class JudgeTimeout(JudgeError, TimeoutError):
    """The judge sent no whole reply within the deadline."""


def image_data_url(image: Any) -> str:
    """A PIL image (or JPEG bytes) as a ``data:image/jpeg;base64,...`` URL."""
    return "data:image/jpeg;base64," + base64.b64encode(image_bytes(image)).decode("ascii")


def loopback(url: str) -> bool:
    """True when `url`'s host is this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key_transport(url: str, api_key: str | None, allow_insecure: bool = False):
    """An API key travels only over https or to this machine: plain http to another host would send it in clear."""
    if api_key in NOT_SECRET or allow_insecure or url.lower().startswith("https://") or loopback(url):
        return
    raise ValueError(f"{redact_url(url)}: refusing to send an API key over plain http to another machine (anyone on "
                     "the way could read it): use https, a server on 127.0.0.1, or allow_insecure_api_key "
                     "(--allow_insecure_api_key) if the network is yours")


class JudgeClient:
    """Chat-completions client for an OpenAI-compatible server, safe to call from many threads at once.

    Each request goes through `utils.core.http.post`: `timeout` bounds an attempt's wall clock (the reply's bytes
    included), connection errors, timeouts, 429 and 5xx are retried `max_retries` times with exponential backoff,
    and `deadline` bounds the whole call (None: the attempts' own bound). The API key (`api_key`, else
    $OPENAI_API_KEY, else "EMPTY", which vLLM accepts) goes only over https or to 127.0.0.1 unless
    `allow_insecure_api_key`."""

    def __init__(self, base_url: str = DEFAULT_JUDGE_URL, model: str = DEFAULT_JUDGE_MODEL, *,
                 api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3, max_concurrency: int = 8,
                 temperature: float = 0.0, max_tokens: int = 512, backoff: float = 0.5,
                 deadline: float | None = None, allow_insecure_api_key: bool = False):
        base_url = base_url.rstrip("/")
        self.url = base_url if base_url.endswith("/chat/completions") else base_url + "/chat/completions"
        self.model = model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # vLLM accepts any key by default
        check_key_transport(self.url, self.api_key, allow_insecure_api_key)
        self.timeout, self.max_retries, self.backoff, self.deadline = timeout, max_retries, backoff, deadline
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.temperature, self.max_tokens = temperature, max_tokens

    def __repr__(self) -> str:  # never the key
        return f"JudgeClient({redact_url(self.url)!r}, {self.model!r})"

    def chat(self, prompt: str, image: Any = None, system: str | None = None, *, reasoning: bool = False,
             **params) -> str:
        """One user turn (image first, then text), after a system turn when `system` is given; returns the
        assistant's text.

        `params` go into the request body over the client's defaults (e.g. seed, top_p, temperature). With
        `reasoning`, a reply whose server split the chain of thought off (`reasoning_content`, as vLLM's
        reasoning parsers and `transformers serve` do) comes back whole: `<think>{reasoning}</think>{content}`.
        """
        content: list[dict] = []
        if image is not None:
            content.append({"type": "image_url", "image_url": {"url": image_data_url(image)}})
        content.append({"type": "text", "text": prompt})
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return self.complete(messages, reasoning=reasoning, **params)

    def complete(self, messages: list[dict], *, reasoning: bool = False, **params) -> str:
        """The assistant's text for chat `messages` (OpenAI's format); `reasoning` and `params` as in `chat`."""
        body = {"model": self.model, "messages": messages,
                "temperature": self.temperature, "max_tokens": self.max_tokens, **params}
        url = redact_url(self.url)
        response = post(self.url, what="judge", json=body, headers={"Authorization": f"Bearer {self.api_key}"},
                        timeout=self.timeout, max_retries=self.max_retries, backoff=self.backoff,
                        deadline=self.deadline, failure=JudgeError, timeout_error=JudgeTimeout)
        if response.status != 200:
            raise JudgeError(f"judge {url} answered HTTP {response.status}: {response.text[-300:]}")
        try:
            message = response.json()["choices"][0]["message"]
            text = message["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise JudgeError(f"judge {url} replied with no choices[0].message.content: {response.text[:300]}") from e
        if not isinstance(text, (str, type(None))):
            raise JudgeError(f"judge {url} replied with a non-text message content: {response.text[:300]}")
        thought = (message.get("reasoning_content") or message.get("reasoning")) if reasoning else None
        return f"<think>{thought}</think>{text or ''}" if thought else text or ""

    def chat_many(self, requests_: Sequence[tuple[str, Any]]) -> list[str]:
        """``chat`` over (prompt, image[, system]) tuples with at most ``max_concurrency`` in flight; input order
        kept."""
        if not requests_:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests_))) as pool:
            return list(pool.map(lambda r: self.chat(*r), requests_))


# --- JSON extraction --------------------------------------------------------------------------------------

_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)


def extract_json(text: str) -> dict | list | None:
    """The last top-level JSON object (or array) in a model reply, or None.

    Tried in order on each candidate: strict JSON; then Python literals (single quotes, True/False/None)
    and JSON with trailing commas. Code-fenced blocks are tried before the bare text.
    """
    if not text:
        return None
    text = _THINK_RE.sub("", text)
    for chunk in [*reversed(_FENCE_RE.findall(text)), text]:
        found = _last_value(chunk)
        if found is not None:
            return found
    return None


def _last_value(text: str):
    """Last top-level object in ``text``, else its last top-level array (prose like "[1]" must not win)."""
    decoder = json.JSONDecoder()
    last = {dict: None, list: None}
    i = 0
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                value = _lenient(text, i)
                end = i + 1 if value is None else _span_end(text, i)
            if isinstance(value, (dict, list)):
                last[type(value)] = value
                i = end
                continue
        i += 1
    return last[dict] if last[dict] is not None else last[list]


def _span_end(text: str, start: int) -> int:
    """Index after the bracket that closes the one at ``start`` (quote-aware), or len(text)."""
    opening = text[start]
    closing = "}" if opening == "{" else "]"
    depth, quote, escaped = 0, None, False
    for j in range(start, len(text)):
        ch = text[j]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _lenient(text: str, start: int):
    span = text[start:_span_end(text, start)]
    span = re.sub(r",\s*([}\]])", r"\1", span)  # trailing commas
    try:
        return json.loads(span)
    except json.JSONDecodeError:
        pass
    py = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", span)))
    try:
        return ast.literal_eval(py)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _truth(value: Any) -> bool | None:
    """Read a yes/no style value: bools, 0/1, and strings such as "yes", "True", "correct", "no"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value >= 0.5
    if isinstance(value, str):
        v = value.strip().strip(".!\"'").casefold()
        if v in ("yes", "y", "true", "1", "correct"):
            return True
        if v in ("no", "n", "false", "0", "incorrect"):
            return False
        first = re.match(r"(yes|no)\b", v)  # "yes, it is" / "no." but not "none"
        if first:
            return first.group(1) == "yes"
    return None


# --- rewards ----------------------------------------------------------------------------------------------

TIIF_PROMPT = """Look at the image and answer each question with yes or no.
{questions}
Reply with JSON only: {{"answers": ["yes" or "no", ...]}} with exactly {n} answers, in question order."""


_prompts = prompt_texts
_images = images_column


def _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff, deadline,
            allow_insecure_api_key) -> JudgeClient:
    return JudgeClient(base_url, model, api_key=api_key, timeout=timeout, max_retries=max_retries,
                       max_concurrency=max_concurrency, max_tokens=max_tokens, backoff=backoff, deadline=deadline,
                       allow_insecure_api_key=allow_insecure_api_key)


def geneval_plus_verdict(reply: str) -> float | None:
    """1.0 when the judge's reply says ``"correct": true`` (or 1), 0.0 for false; None when no verdict can be read
    from it (no score rather than a silent 0: the trainer leaves such images out and counts them)."""
    data = extract_json(reply)
    value = data.get("correct") if isinstance(data, dict) else None
    if value is None:  # no parsable object: look for the key itself
        m = re.search(r"[\"']?correct[\"']?\s*[:=]\s*[\"']?(\w+)", reply or "", re.IGNORECASE)
        value = m.group(1) if m else None
    truth = _truth(value)
    return None if truth is None else float(truth)


def judge_geneval_plus_reward(base_url: str = DEFAULT_JUDGE_URL, model: str = DEFAULT_JUDGE_MODEL,
                              api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3,
                              max_concurrency: int = 8, max_tokens: int = 512, backoff: float = 0.5,
                              prompt_template: str = GENEVAL_PLUS_PROMPT, system_prompt: str = GENEVAL_PLUS_SYSTEM,
                              prompt_column: str = "prompt", deadline: float | None = None,
                              allow_insecure_api_key: bool = False):
    """GenEval++ judge (R3's): ``fn(completions, images=[PIL, ...], prompt=[...], include=[[item, ...]],
    exclude=[[item, ...]])`` -> 1.0 / 0.0 per image, None for an image that is None or a reply with no verdict.

    Each request: ``system_prompt``, then a user turn with the image and ``prompt_template`` formatted with
    ``prompt=`` and ``checklist=`` (`geneval_plus_checklist` of the row's include / exclude items).
    """
    client = _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff, deadline,
                     allow_insecure_api_key)
    return RewardFunction("judge_geneval_plus", _judge_geneval_plus, client=client, prompt_template=prompt_template,
                          system_prompt=system_prompt, prompt_column=prompt_column)


def _judge_geneval_plus(completions, images=None, *, client, prompt_template, system_prompt, prompt_column,
                        **columns) -> list[float | None]:
    n = len(completions)
    images = _images(images, n, "judge_geneval_plus")
    prompts = _prompts(columns, n, "judge_geneval_plus", prompt_column)
    include = optional_column(columns, "include", n, "judge_geneval_plus")
    if include is None:
        raise ValueError(f"reward 'judge_geneval_plus' needs the GenEval metadata column 'include' (its checklist); "
                         f"columns given: {sorted(columns)}")
    exclude = optional_column(columns, "exclude", n, "judge_geneval_plus") or [None] * n
    keep = [i for i in range(n) if images[i] is not None]
    replies = client.chat_many([(prompt_template.format(prompt=prompts[i].strip(), checklist=geneval_plus_checklist(
        include[i] or [], exclude[i])), images[i], system_prompt) for i in keep])
    out: list[float | None] = [None] * n
    for i, reply in zip(keep, replies):
        out[i] = geneval_plus_verdict(reply)
    return out


def tiif_answers(reply: str, n_questions: int) -> list[bool | None]:
    """The judge's yes/no answers in question order (None where it gave none)."""
    data = extract_json(reply)
    answers: Any = None
    if isinstance(data, dict):
        answers = data.get("answers", data.get("answer"))
        if answers is None:  # {"1": "yes", "2": "no"} style
            keyed = {str(k).strip().rstrip("."): v for k, v in data.items()}
            answers = [keyed.get(str(i + 1)) for i in range(n_questions)]
    elif isinstance(data, list):
        answers = data
    if not isinstance(answers, list):
        # no JSON: numbered lines "1. yes" / "2: no"
        found = dict(re.findall(r"(?m)^\s*(\d+)\s*[.):-]\s*(yes|no)\b", reply or "", re.IGNORECASE))
        answers = [found.get(str(i + 1)) for i in range(n_questions)]
    answers = [_truth(a) for a in answers[:n_questions]]
    return answers + [None] * (n_questions - len(answers))


def tiif_score(reply: str, expected: Sequence[Any]) -> float | None:
    """Fraction of the expected yes/no answers the judge's reply matches; None when no answer at all can be read
    from it (no score rather than a silent 0, as GenEval++: the trainer leaves such images out and counts them)."""
    expected_truth = [_truth(e) for e in expected]
    got = tiif_answers(reply, len(expected_truth))
    if all(g is None for g in got):
        return None
    return sum(g is not None and g == e for g, e in zip(got, expected_truth)) / len(expected_truth)


def judge_tiif_reward(base_url: str = DEFAULT_JUDGE_URL, model: str = DEFAULT_JUDGE_MODEL,
                      api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3,
                      max_concurrency: int = 8, max_tokens: int = 512, backoff: float = 0.5,
                      prompt_template: str = TIIF_PROMPT, deadline: float | None = None,
                      allow_insecure_api_key: bool = False):
    """TIIF judge: ``fn(completions, images=[...], yn_question_list=[[q, ...]], yn_answer_list=[["yes", ...]])``.

    One request per image asks all of its questions; the reward is the fraction answered as in
    ``yn_answer_list``. Rows without questions or without an image, and replies with no readable answer, get None.
    """
    client = _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff, deadline,
                     allow_insecure_api_key)
    return RewardFunction("judge_tiif", _judge_tiif, client=client, prompt_template=prompt_template)


def _judge_tiif(completions, images=None, *, client, prompt_template, **columns) -> list[float | None]:
    n = len(completions)
    images = _images(images, n, "judge_tiif")
    questions = optional_column(columns, "yn_question_list", n, "judge_tiif")
    expected = optional_column(columns, "yn_answer_list", n, "judge_tiif")
    if questions is None or expected is None:
        raise ValueError(f"reward 'judge_tiif' needs the TIIF columns 'yn_question_list' and 'yn_answer_list'; "
                         f"columns given: {sorted(columns)}")
    for row, (q, a) in enumerate(zip(questions, expected)):
        if q is not None and len(q) != len(a or []):
            raise ValueError(f"reward 'judge_tiif': row {row} has {len(q)} questions in yn_question_list but "
                             f"{len(a or [])} answers in yn_answer_list")
    keep = [i for i in range(n) if images[i] is not None and questions[i]]
    requests_ = []
    for i in keep:
        listing = "\n".join(f"{k + 1}. {q}" for k, q in enumerate(questions[i]))
        requests_.append((prompt_template.format(questions=listing, n=len(questions[i])), images[i]))
    out: list[float | None] = [None] * n
    for i, reply in zip(keep, client.chat_many(requests_)):
        out[i] = tiif_score(reply, expected[i])
    return out
