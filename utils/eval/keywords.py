"""Reasoning-keyword statistics (OpenVLThinker-style): how often responses look at the image, digest the
question, plan, reflect and try alternatives."""

from __future__ import annotations

import json
import os
import re

# Reasoning-keyword groups for OpenVLThinker-style analysis of how a model reasons: looking at the image,
# digesting the question, planning, reflecting (self-checks) and trying alternatives. Whole-word,
# case-insensitive matches; phrases count as one hit.
KEYWORD_GROUPS = {
    "visual": ("image", "picture", "figure", "diagram", "shown", "see", "look", "observe", "visible"),
    "digest": ("question", "given", "asks", "means", "understand", "note", "notice"),
    "plan": ("first", "next", "then", "step", "plan", "need to", "let's", "approach"),
    "reflection": ("wait", "check", "verify", "double-check", "recheck", "re-examine", "mistake", "hmm"),
    "alternate": ("alternatively", "another", "instead", "on the other hand", "other way"),
}


def _keyword_pattern(word):
    return re.compile(r"(?<![\w-])" + r"\s+".join(map(re.escape, word.split())) + r"(?![\w-])", re.IGNORECASE)


def keyword_frequencies(texts, groups=None):
    """Per group: hits per response, share of responses with at least one hit, and per-word counts."""
    groups = groups or KEYWORD_GROUPS
    n = max(len(texts), 1)
    out = {}
    for group, words in groups.items():
        counts = {w: 0 for w in words}
        responses_with_hit = 0
        for text in texts:
            hits = 0
            for word in words:
                found = len(_keyword_pattern(word).findall(text))
                counts[word] += found
                hits += found
            responses_with_hit += hits > 0
        out[group] = {"per_response": sum(counts.values()) / n, "response_rate": responses_with_hit / n,
                      "words": counts}
    return out


def compare_keywords(current, other):
    """Per group: current and other hits per response and their difference (current - other)."""
    return {group: {"current": current[group]["per_response"], "other": other[group]["per_response"],
                    "delta": current[group]["per_response"] - other[group]["per_response"]}
            for group in current if group in other}


def load_texts(path):
    """Completion texts from an evaluate.py output: its folder, generations.jsonl, or a predictions.json."""
    if os.path.isdir(path):
        path = os.path.join(path, "generations.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--compare: {path} not found (give an evaluate.py output folder, its "
                                "generations.jsonl or a crystal-metrics predictions.json)")
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["completion"] for line in f if line.strip()]
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"--compare: {path} is not a JSON object keyed by sample id")
    return [" ".join(v.get("reasoning_steps") or []) + " " + str(v.get("answer", "")) for v in data.values()]


def keyword_shares(texts, groups=None):
    """{"hits": all keyword hits in `texts`, "shares": {word: its share of them}} over the words of KEYWORD_GROUPS
    (every word, zeros included, in KEYWORD_GROUPS order)."""
    words = [w for ws in (groups or KEYWORD_GROUPS).values() for w in ws]
    counts = [sum(len(_keyword_pattern(w).findall(t)) for t in texts) for w in words]
    total = sum(counts)
    return {"hits": total, "shares": {w: c / max(total, 1) for w, c in zip(words, counts)}}


def sft_efficacy_score(base_texts, sft_texts, groups=None, cap=2.0):
    """How much SFT raised the reasoning keywords, as the OpenVLThinker card scores it: each keyword's share of
    all keyword hits in the SFT model's responses over its share in the base model's (a share of 0 counts as
    1e-6), averaged over the keywords and capped at `cap` (2). Keywords: the words of KEYWORD_GROUPS. A base
    that uses no keyword makes every used keyword's ratio 1e6: the score then sits at its cap whatever SFT did,
    so read it beside `keyword_shares` of both."""
    base, sft = keyword_shares(base_texts, groups)["shares"], keyword_shares(sft_texts, groups)["shares"]
    ratios = [sft[w] / max(base[w], 1e-6) for w in sft]
    return min(sum(ratios) / len(ratios), cap) if ratios else 1.0
