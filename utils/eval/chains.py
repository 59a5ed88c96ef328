"""Reasoning chains for distilled SFT data (OpenVLThinker): split a chain into reasoning and final answer, grade
the answer, pick one correct chain, cut its reflections, cap its length, and write it as an SFT target.
distill.py runs these filters on every question; docs/openvlthinker.md has the rules and why.

A chain is whatever the reasoner (or the model) wrote: R1-style `<think>...</think>` then an answer, with the
answer in `<answer>...</answer>` or `\\boxed{...}`. The SFT target is `<think>{reasoning}</think><answer>{answer}
</answer>`, the format the `think_answer` prompt asks for and `think_format` rewards.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rewards.text import answers_match, extract_answer
from utils.eval.grading import AnswerGrader

REFLECTION_MARKERS = ("Wait", "But wait", "But the question")  # OpenVLThinker's cut points
SELECT_RULES = ("shortest", "longest", "next_longest")
DROP_REASONS = ("no_answer", "wrong_answer", "empty_after_cut", "over_word_limit")

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def boxed_answers(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` in text, braces balanced (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`)."""
    found, start = [], 0
    while (start := text.find("\\boxed{", start)) != -1:
        depth, i = 0, start + len("\\boxed")
        for i in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
        if depth == 0:
            found.append(text[start + len("\\boxed{"):i].strip())
        start += len("\\boxed{")
    return found


def final_answer(text: str) -> str | None:
    """The last `<answer>` block, else the last `\\boxed{}`; None when there is neither (or it is empty)."""
    answers = [a.strip() for a in _ANSWER_RE.findall(text)] or boxed_answers(text)
    return answers[-1] if answers and answers[-1] else None


def parse_chain(text: str) -> tuple[str, str | None]:
    """(reasoning, final answer) of a chain.

    The reasoning is the `<think>` block (its opening tag may be missing: R1-style chat templates put it in
    the prompt); without one, everything before the answer. The answer is looked for after `</think>`
    first, so a `\\boxed{}` drafted inside the thinking does not count as the final word.
    """
    if _THINK_CLOSE in text:
        head, tail = text.split(_THINK_CLOSE, 1)
        reasoning = head.split(_THINK_OPEN, 1)[-1]
        return reasoning.strip(), final_answer(tail) or final_answer(head)
    answer = final_answer(text)
    cut = [m.start() for m in (_ANSWER_RE.search(text), re.search(r"\\boxed\{", text)) if m]
    reasoning = text[:min(cut)] if cut else text
    return reasoning.replace(_THINK_OPEN, "").strip(), answer


def cut_reflection(reasoning: str, markers=REFLECTION_MARKERS) -> tuple[str, bool]:
    """The reasoning up to the first reflection marker (case-sensitive, whole words), and whether it was cut."""
    hits = [m.start() for marker in markers
            for m in [re.search(r"(?<![\w])" + re.escape(marker) + r"(?![\w])", reasoning)] if m]
    if not hits:
        return reasoning, False
    return reasoning[:min(hits)].rstrip(), True


def word_count(text: str) -> int:
    return len(text.split())


def select_chain(lengths: list[int], rule: str = "shortest") -> int:
    """Index of the chain to keep among correct chains of these lengths (ties: the first).

    shortest: the OpenVLThinker report's rule; longest; next_longest: the second longest (the longest when
    there is one chain), what the authors' later generation code keeps.
    """
    if not lengths:
        raise ValueError("select_chain: no chains to choose from")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if rule == "shortest":
        return order[0]
    by_length_desc = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if rule == "longest":
        return by_length_desc[0]
    if rule == "next_longest":
        return by_length_desc[1] if len(lengths) > 1 else by_length_desc[0]
    raise ValueError(f"--select {rule!r} is not one of {list(SELECT_RULES)}")


def sft_target(reasoning: str, answer: str) -> str:
    return f"{_THINK_OPEN}{reasoning.strip()}{_THINK_CLOSE}<answer>{answer.strip()}</answer>"


class Grader:
    """Is a predicted answer right? math-verify (with OpenVLThinker's normalisation, rewards.text.answers_match),
    then CRYSTAL's answer rules (numeric tolerance, yes/no, options: utils.eval.grading.AnswerGrader)."""

    def __init__(self):
        self.crystal = AnswerGrader()

    def __call__(self, question: str, predicted: str, gold: str) -> bool:
        gold = extract_answer(str(gold)) or str(gold)
        if answers_match(gold, predicted):
            return True
        return self.crystal(question, predicted, gold)


@dataclass
class Outcome:
    """What the filters made of one question's chains: the SFT target (None when dropped) and why."""

    target: str | None
    reason: str  # "kept" or one of DROP_REASONS
    answers: list[str | None] = field(default_factory=list)  # each chain's final answer
    correct: list[bool] = field(default_factory=list)
    chosen: int | None = None  # index of the selected chain
    cut: bool = False  # a reflection was cut from the selected chain
    words: int = 0  # words of the kept reasoning


def filter_chains(chains: list[str], *, question: str, gold: str, grade, select: str = "shortest",
                  cut_reflections: bool = True, markers=REFLECTION_MARKERS, max_words: int | None = 500) -> Outcome:
    """Grade every chain, keep one correct chain by `select` (lengths in words of its reasoning), cut its
    reflections, drop it when its reasoning is empty after the cut or over `max_words` words."""
    parsed = [parse_chain(c) for c in chains]
    answers = [a for _, a in parsed]
    correct = [a is not None and bool(grade(question, a, gold)) for a in answers]
    out = Outcome(None, "", answers=answers, correct=correct)
    good = [i for i, ok in enumerate(correct) if ok]
    if not good:
        out.reason = "no_answer" if all(a is None for a in answers) else "wrong_answer"
        return out
    out.chosen = good[select_chain([word_count(parsed[i][0]) for i in good], select)]
    reasoning, answer = parsed[out.chosen]
    if cut_reflections:
        reasoning, out.cut = cut_reflection(reasoning, markers)
    out.words = word_count(reasoning)
    if not reasoning.strip():
        out.reason = "empty_after_cut"
    elif max_words and out.words > max_words:
        out.reason = "over_word_limit"
    else:
        out.reason, out.target = "kept", sft_target(reasoning, answer)
    return out
