"""The SFT efficacy score sits at its cap (2) whenever the base uses no reasoning keyword; the report puts the
keyword shares of the base and the SFT model beside it, so the figure says what SFT taught."""

import json

import iterate
from iterate import IterateConfig
from utils.eval.keywords import keyword_shares, sft_efficacy_score


def test_keyword_shares_and_the_capped_score():
    counted = keyword_shares(["I see two. Let me check: two.", "First, look at the image."])
    assert counted["hits"] == 5
    assert {w: v for w, v in counted["shares"].items() if v} == {"see": 0.2, "check": 0.2, "look": 0.2,
                                                                 "image": 0.2, "first": 0.2}
    assert keyword_shares(["a red circle."]) == {"hits": 0, "shares": {w: 0.0 for w in counted["shares"]}}
    # no keyword in the base: capped whatever SFT did; the same shares in both: 1 per used word, averaged over all
    assert sft_efficacy_score(["a red circle."], ["I see it."]) == 2.0
    words = len(counted["shares"])
    assert sft_efficacy_score(["I see it, let me check."], ["I see two, let me check."]) == 2 / words


def test_the_report_puts_the_keyword_shares_beside_the_score(tmp_path):
    def write_eval(name, accuracy, texts):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "metrics.json").write_text(json.dumps({"samples": len(texts), "accuracy": accuracy}))
        (folder / "generations.jsonl").write_text("".join(json.dumps({"completion": t}) + "\n" for t in texts))
        return str(folder)

    base = write_eval("eval-base", 0.1, ["a red circle.", "a blue square."])
    evals = {s: write_eval(s, 0.5, ["I see two. Let me check: two.", "There are two."])
             for s in ("sft", "grpo-medium", "grpo-hard")}
    report = iterate.write_report(IterateConfig(output_dir=str(tmp_path)), base,
                                  [{"cycle": 1, "data": {}, "evals": evals, "seconds": 1.0}])
    cycle = report["cycles"][0]
    assert cycle["sft_efficacy"] == 2.0
    assert cycle["sft_keywords"] == {"base": {"hits_per_response": 0.0, "shares": {}},
                                     "sft": {"hits_per_response": 1.0, "shares": {"see": 0.5, "check": 0.5}}}
    assert json.loads((tmp_path / "report.json").read_text())["cycles"][0]["sft_keywords"] == cycle["sft_keywords"]
