"""VLM-as-judge rewards over any OpenAI-compatible chat endpoint (e.g. vLLM serving Qwen2.5-VL-72B-AWQ).

The image travels inline as a base64 data URL; requests run in a bounded thread pool, each with a timeout
and retries (connection errors, timeouts, 429 and 5xx, exponential backoff). Replies are read with a
tolerant JSON extractor: reasoning blocks, code fences, prose around the object, Python-style literals
and trailing commas are all handled.

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
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import requests

from rewards.common import RewardFunction, image_bytes, images_column, optional_column, prompt_texts
from rewards.geneval import GENEVAL_PLUS_PROMPT, GENEVAL_PLUS_SYSTEM, geneval_plus_checklist

logger = logging.getLogger(__name__)

DEFAULT_JUDGE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_JUDGE_MODEL = "Qwen/Qwen2.5-VL-72B-Instruct-AWQ"


class JudgeError(RuntimeError):
    """The judge endpoint could not be reached or replied with something that is not a chat completion."""


def image_data_url(image: Any) -> str:
    """A PIL image (or JPEG bytes) as a ``data:image/jpeg;base64,...`` URL."""
    return "data:image/jpeg;base64," + base64.b64encode(image_bytes(image)).decode("ascii")


class JudgeClient:
    """Chat-completions client for an OpenAI-compatible server, safe to call from many threads at once."""

    def __init__(self, base_url: str = DEFAULT_JUDGE_URL, model: str = DEFAULT_JUDGE_MODEL, *,
                 api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3, max_concurrency: int = 8,
                 temperature: float = 0.0, max_tokens: int = 512, backoff: float = 0.5):
        base_url = base_url.rstrip("/")
        self.url = base_url if base_url.endswith("/chat/completions") else base_url + "/chat/completions"
        self.model = model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # vLLM accepts any key by default
        self.timeout, self.max_retries, self.backoff = timeout, max_retries, backoff
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.temperature, self.max_tokens = temperature, max_tokens
        self._local = threading.local()  # one requests.Session per thread

    def __getstate__(self) -> dict:  # sessions are per thread and per process: rebuild them after pickling
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

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
        body = {"model": self.model, "messages": messages,
                "temperature": self.temperature, "max_tokens": self.max_tokens, **params}
        headers = {"Authorization": f"Bearer {self.api_key}"}
        last_error = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._session().post(self.url, json=body, headers=headers, timeout=self.timeout)
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                last_error = f"{type(e).__name__}: {e}"
                logger.warning("judge %s: %s (attempt %d/%d)", self.url, last_error, attempt + 1, self.max_retries + 1)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[-300:]}"
                logger.warning("judge %s: %s (attempt %d/%d)", self.url, last_error, attempt + 1, self.max_retries + 1)
                continue
            if response.status_code != 200:
                raise JudgeError(f"judge {self.url} answered HTTP {response.status_code}: {response.text[-300:]}")
            try:
                message = response.json()["choices"][0]["message"]
                text = message["content"]
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise JudgeError(f"judge {self.url} replied with no choices[0].message.content: "
                                 f"{response.text[:300]}") from e
            if not isinstance(text, (str, type(None))):
                raise JudgeError(f"judge {self.url} replied with a non-text message content: {response.text[:300]}")
            thought = (message.get("reasoning_content") or message.get("reasoning")) if reasoning else None
            return f"<think>{thought}</think>{text or ''}" if thought else text or ""
        raise JudgeError(f"judge {self.url} failed after {self.max_retries + 1} attempts "
                         f"(timeout={self.timeout}s); last error: {last_error}")

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


def _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff) -> JudgeClient:
    return JudgeClient(base_url, model, api_key=api_key, timeout=timeout, max_retries=max_retries,
                       max_concurrency=max_concurrency, max_tokens=max_tokens, backoff=backoff)


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
                              prompt_column: str = "prompt"):
    """GenEval++ judge (R3's): ``fn(completions, images=[PIL, ...], prompt=[...], include=[[item, ...]],
    exclude=[[item, ...]])`` -> 1.0 / 0.0 per image, None for an image that is None or a reply with no verdict.

    Each request: ``system_prompt``, then a user turn with the image and ``prompt_template`` formatted with
    ``prompt=`` and ``checklist=`` (`geneval_plus_checklist` of the row's include / exclude items).
    """
    client = _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff)
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


def tiif_score(reply: str, expected: Sequence[Any]) -> float:
    """Fraction of the expected yes/no answers the judge's reply matches."""
    expected_truth = [_truth(e) for e in expected]
    got = tiif_answers(reply, len(expected_truth))
    return sum(g is not None and g == e for g, e in zip(got, expected_truth)) / len(expected_truth)


def judge_tiif_reward(base_url: str = DEFAULT_JUDGE_URL, model: str = DEFAULT_JUDGE_MODEL,
                      api_key: str | None = None, timeout: float = 60.0, max_retries: int = 3,
                      max_concurrency: int = 8, max_tokens: int = 512, backoff: float = 0.5,
                      prompt_template: str = TIIF_PROMPT):
    """TIIF judge: ``fn(completions, images=[...], yn_question_list=[[q, ...]], yn_answer_list=[["yes", ...]])``.

    One request per image asks all of its questions; the reward is the fraction answered as in
    ``yn_answer_list``. Rows without questions or without an image get None.
    """
    client = _client(base_url, model, api_key, timeout, max_retries, max_concurrency, max_tokens, backoff)
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
