"""Cycle >= 2's SFT rows through a served model: distill.py --chain_source model --model_serve asks the previous
cycle's VLM through `transformers serve` on 127.0.0.1 (the same client as any OpenAI-compatible endpoint), with the
template's system turn, as in-process generation asks it."""

import os

import pytest

from distill import DistillConfig, read_records
from distill import main as distill_main


def test_the_served_vlm_is_asked_with_its_templates_system_turn(monkeypatch):
    import rewards.judge
    from rewards.judge import JudgeClient
    from utils.core.http import Reply

    sent = []

    def post(url, *, json, **request):  # the client's one HTTP call
        sent.append(json)
        return Reply(200, b'{"choices": [{"message": {"content": "<answer>2</answer>"}}]}')

    client = JudgeClient("http://127.0.0.1:9/v1", "m")
    monkeypatch.setattr(rewards.judge, "post", post)
    assert client.chat("How many?", system="Think first.") == "<answer>2</answer>"
    assert [m["role"] for m in sent[0]["messages"]] == ["system", "user"]
    assert sent[0]["messages"][0]["content"] == "Think first."
    client.chat("How many?")
    assert [m["role"] for m in sent[1]["messages"]] == ["user"]


@pytest.fixture(scope="module")
def answering_vlm(tmp_path_factory):
    """(questions.jsonl, rows, a tiny VLM that has learnt those questions' think/answer chains by heart)."""
    from tests.distill_helpers import _memorize, write_questions
    from tiny.cache import save_sharegpt
    from tiny.cycle import reasoner_chain
    from tiny.models import make_tiny_vlm
    from utils.core.prompts import THINK_ANSWER_SYSTEM

    folder = tmp_path_factory.mktemp("answering-vlm")
    path, rows = write_questions(str(folder), n=8)
    data = save_sharegpt([{"id": r["id"], "images": [r["image"]], "messages": [
        {"role": "system", "content": THINK_ANSWER_SYSTEM}, {"role": "user", "content": "<image>" + r["question"]},
        {"role": "assistant", "content": reasoner_chain(r)}]} for r in rows], str(folder / "chains"))
    return path, rows, _memorize(make_tiny_vlm(str(folder / "vlm")), data, len(rows), str(folder), 120,
                                 logging_steps=40)


@pytest.mark.slow
@pytest.mark.full
def test_regeneration_through_transformers_serve_keeps_what_in_process_generation_keeps(answering_vlm, tmp_path):
    path, rows, vlm = answering_vlm
    flags = dict(dataset=path, chain_source="model", model=vlm, prompt_template="think_answer", num_chains=2,
                 temperature=0.0, max_new_tokens=48, max_concurrency=2, batch_size=8, cpu_threads=1)
    served = distill_main(DistillConfig(**flags, model_serve=True, output_dir=str(tmp_path / "served")))
    distill_main(DistillConfig(**flags, output_dir=str(tmp_path / "local")))
    ids = {r["id"] for r in rows}
    kept = {r["id"]: r for r in read_records(str(tmp_path / "served" / "sft.jsonl"))}
    drops = read_records(str(tmp_path / "served" / "drops.jsonl"))
    assert set(kept) | {d["id"] for d in drops} == ids and all(r["chains"] == 2 for r in kept.values())
    assert served["kept"] >= len(rows) // 2, drops  # the memorised VLM answers most of them right when served
    local_kept = {r["id"] for r in read_records(str(tmp_path / "local" / "sft.jsonl"))}
    assert len(set(kept) ^ local_kept) <= 1, (sorted(kept), sorted(local_kept))  # images go as JPEG when served
    log = (tmp_path / "served" / "model_server.log").read_text()
    assert "chat/completions" in log and os.path.isabs(vlm)
