import json
import os

import pytest
import torch
from datasets import DatasetDict
from PIL import Image
from safetensors.torch import load_file

import train_sft
import utils.core.run
from tests.launch_helpers import cli, failing_fixture, finish, launch, launch_fsdp2
from tiny.models import make_tiny_llm, make_tiny_vlm
from tiny.shapes import make_shapes_vqa
from tiny.tokenizer import FAMILIES
from train_sft import AssistantNLL, SFTConfig, main, validate
from utils.core.config import ConfigError, parse_config
from utils.core.models import load_model_and_processor
from utils.core.prompts import crystal_json_target
from utils.core.sft_data import IGNORE_INDEX, encode_sft_batch, sharegpt_conversation, vqa_conversation

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_models")
    with failing_fixture(f"tests/test_sft.py's tiny VLMs ({', '.join(FAMILIES)})"):
        return {family: make_tiny_vlm(root / family, family=family) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(tiny):
    return {family: load_model_and_processor(path) for family, path in tiny.items()}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data") / "shapes"
    with failing_fixture("tests/test_sft.py's shapes set (16 train, 8 test rows)"):
        DatasetDict({"train": make_shapes_vqa(16, seed=0), "test": make_shapes_vqa(8, seed=1)}).save_to_disk(
            str(path))
    return str(path)


def _image(colour):
    return Image.new("RGB", (84, 84), colour)


VQA_ROWS = [
    dict(id="a", image=_image("red"), question="How many circles are there?", answer="2",
         reference_steps=["There are circles in the top left and the middle center", "There are 2 circles"]),
    dict(id="b", image=_image("blue"), question="What color is the square?", answer="blue",
         reference_steps=["The square is blue"], choices=["red", "blue"]),
]
SHAREGPT_ROW = {"messages": [{"role": "user", "content": "<image>What is it?"},
                             {"role": "assistant", "content": "<think>A red square.</think><answer>red</answer>"},
                             {"role": "user", "content": "And this <image> one?"},
                             {"role": "assistant", "content": "It is blue"}],
                "images": [_image("red"), _image("blue")]}
# The assistant texts each row trains on, in order.
EXPECTED_TARGETS = [
    [crystal_json_target(VQA_ROWS[0]["reference_steps"], "2")],
    [crystal_json_target(VQA_ROWS[1]["reference_steps"], "blue")],
    ["<think>A red square.</think><answer>red</answer>", "It is blue"],
]


def _conversations():
    return [vqa_conversation(r) for r in VQA_ROWS] + [sharegpt_conversation(SHAREGPT_ROW)]


def _batch(processor, max_length=None):
    conversations = _conversations()
    return encode_sft_batch(processor, [c[0] for c in conversations], [c[1] for c in conversations],
                            sample_ids=["a", "b", "c"], max_length=max_length)


# ---------------------------------------------------------------- conversations


def test_sharegpt_markers_become_image_items_in_place():
    messages, images = sharegpt_conversation(SHAREGPT_ROW, system_prompt="Be brief.")
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert messages[3]["content"] == [{"type": "text", "text": "And this "}, {"type": "image"},
                                      {"type": "text", "text": " one?"}]
    assert len(images) == 2


def test_vqa_conversation_builds_the_target_from_steps_and_answer():
    messages, images = vqa_conversation(VQA_ROWS[1], response_template="think_answer")
    assert messages[0]["role"] == "system" and "<think>" in messages[0]["content"][0]["text"]
    assert messages[1]["content"][-1]["text"] == "What color is the square?\n\nA) red\nB) blue"
    assert messages[-1]["content"][0]["text"] == "<think>The square is blue</think><answer>blue</answer>"
    with pytest.raises(ValueError, match="--response_template"):
        vqa_conversation(VQA_ROWS[0], response_template="xml")


# ---------------------------------------------------------------- assistant-only labels


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_are_exactly_the_assistant_tokens(loaded, family):
    _, processor = loaded[family]
    tokenizer = processor.tokenizer
    batch = _batch(processor)
    end_of_turn = tokenizer.eos_token_id  # <|im_end|> for ChatML, <|endoftext|> for GLM
    for row, targets in enumerate(EXPECTED_TARGETS):
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        expected = []
        for text in targets:
            expected += tokenizer(text, add_special_tokens=False).input_ids + [end_of_turn]
        # token by token: the labelled positions hold exactly the assistant tokens (and the end of each turn)
        assert labels[labels != IGNORE_INDEX].tolist() == expected
        assert torch.equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
        # nothing else is labelled: no system/user text, no image token, no padding
        image_ids = {processor.image_token_id} if hasattr(processor, "image_token_id") else set()
        labelled_ids = set(labels[labels != IGNORE_INDEX].tolist())
        assert not labelled_ids & image_ids
        assert (labels[batch["attention_mask"][row] == 0] == IGNORE_INDEX).all()
    # right padding, and image tokens were expanded (9 per 84 px image)
    assert batch["attention_mask"][:, 0].all()
    assert "pixel_values" in batch


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_agree_with_the_templates_generation_markers(loaded, family):
    # The tiny templates mark assistant text with {% generation %}; transformers turns that into a mask by
    # its own route. Our prefix-diff labels (which need no markers) must agree position by position.
    _, processor = loaded[family]
    batch = _batch(processor)
    conversations = _conversations()
    for row, (messages, images) in enumerate(conversations):
        # the images ride in the messages (the documented route, the same in the vLLM set's 5.20 and in 5.24)
        pending = iter(images)
        messages = [dict(m, content=[dict(c, image=next(pending)) if c.get("type") == "image" else c
                                     for c in m["content"]]) if isinstance(m["content"], list) else m
                    for m in messages]
        reference = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True, return_tensors="pt")
        keep = batch["attention_mask"][row].bool()
        assert torch.equal(batch["input_ids"][row][keep], reference["input_ids"][0])
        assert torch.equal((batch["labels"][row][keep] != IGNORE_INDEX).long(), reference["assistant_masks"][0].long())


def test_text_only_llm_gets_the_same_labels(tmp_path):
    model, tokenizer = load_model_and_processor(make_tiny_llm(tmp_path / "llm"))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yes"}]
    batch = encode_sft_batch(tokenizer, [messages], [[]], sample_ids=["t"])
    labels = batch["labels"][0]
    assert labels[labels != IGNORE_INDEX].tolist() == tokenizer("yes", add_special_tokens=False).input_ids + [
        tokenizer.eos_token_id]


def test_max_length_cuts_only_the_last_answer(loaded):
    _, processor = loaded["qwen2_5_vl"]
    full = _batch(processor)
    prompt_end = max(int((row != IGNORE_INDEX).nonzero()[0]) for row in full["labels"][:2])
    cut = prompt_end + 3
    conversations = _conversations()[:2]
    batch = encode_sft_batch(processor, [c[0] for c in conversations], [c[1] for c in conversations],
                             sample_ids=["a", "b"], max_length=cut)
    assert batch["input_ids"].shape[1] == cut
    assert torch.equal(batch["labels"], full["labels"][:2, :cut])
    with pytest.raises(ValueError, match=r"sample 'a'.*--max_length 20"):
        encode_sft_batch(processor, [c[0] for c in conversations], [c[1] for c in conversations],
                         sample_ids=["a", "b"], max_length=20)


def test_conversation_without_assistant_text_is_rejected(loaded):
    _, processor = loaded["qwen2_5_vl"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match="sample 'z': no assistant text"):
        encode_sft_batch(processor, [messages], [[]], sample_ids=["z"])


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_equals_transformers_loss_on_the_same_labels(loaded, family):
    model, processor = loaded[family]
    batch = _batch(processor)
    n_tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    ours = AssistantNLL(model)(batch) / n_tokens
    theirs = model(**{k: v for k, v in batch.items() if k != "labels"}, labels=batch["labels"]).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # and the gradients agree too (the fused head has its own backward)
    grads = []
    for loss in (ours, theirs):
        model.zero_grad()
        loss.backward()
        grads.append(model.get_output_embeddings().weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    model.zero_grad()


# ---------------------------------------------------------------- flags


def test_impossible_flag_combinations_fail_before_loading():
    with pytest.raises(ConfigError, match="--hub_model_id"):
        validate(SFTConfig(push_to_hub=True))
    with pytest.raises(ConfigError, match="--freeze_vision_tower"):
        validate(SFTConfig(freeze_multi_modal_projector=True))
    with pytest.raises(ConfigError, match="--per_device_train_batch_size"):
        validate(SFTConfig(per_device_train_batch_size=0))
    with pytest.raises(ConfigError, match="--prompt_template"):
        validate(SFTConfig(prompt_template="json"))


def test_recipes_parse():
    from utils.core.config import parse_config

    tiny = parse_config(SFTConfig, ["--config", train_sft.TINY_SFT_RECIPE])
    assert tiny.output_dir == "outputs/tiny-sft" and tiny.report_to is None and tiny.eval_dataset_name
    published = parse_config(SFTConfig, ["--config", os.path.join(os.path.dirname(train_sft.TINY_SFT_RECIPE),
                                                                  "openvlthinker_sft.yaml")])
    assert published.freeze_vision_tower and published.bf16 and published.dataset_format == "sharegpt"
    assert (published.learning_rate, published.lr_scheduler_type, published.warmup_ratio,
            published.num_train_epochs, published.max_pixels) == (5e-6, "cosine", 0.15, 1.0, 262144)


# ---------------------------------------------------------------- end to end


def _config(tiny, shapes, out, **overrides):
    values = dict(model_name_or_path=tiny["qwen2_5_vl"], dataset_name=shapes, per_device_train_batch_size=4,
                  learning_rate=1e-3, lr_scheduler_type="constant", max_steps=3, save_steps=1, logging_steps=1,
                  max_length=512, output_dir=str(out), report_to="none", seed=0)
    values.update(overrides)
    return SFTConfig(**values)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


@pytest.mark.slow
def test_training_lowers_the_loss_on_a_repeated_batch_and_reports_heldout_accuracy(tiny, tmp_path, monkeypatch):
    pushes = []

    class RecordingUploader:
        def __init__(self, repo_id, **kwargs):
            self.repo_id = repo_id

        def push(self, path, **card):
            pushes.append((self.repo_id, os.path.basename(path), card["script"]))

        def wait(self):
            pass

    monkeypatch.setattr(utils.core.run, "HubUploader", RecordingUploader)  # the uploader start_logging makes
    data = tmp_path / "four"
    DatasetDict({"train": make_shapes_vqa(4, seed=0), "test": make_shapes_vqa(4, seed=1)}).save_to_disk(str(data))
    out = tmp_path / "run"
    # batch 4 of a 4-row set: every step sees the same rows
    main(_config(tiny, str(data), out, eval_dataset_name=str(data), eval_samples=4, eval_max_new_tokens=8,
                 push_to_hub=True, hub_model_id="me/tiny-sft"))
    losses = _losses(out)
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
    assert {"checkpoint-1", "checkpoint-2", "checkpoint-3"} <= set(os.listdir(out))
    for name in ("config.json", "model.safetensors", "trainer_state.json", "tokenizer.json"):
        assert os.path.isfile(out / "checkpoint-3" / name), name
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["global_step"] == 3 and 0.0 <= summary["heldout_accuracy"] <= 1.0
    assert summary["heldout_samples"] == 4
    assert os.path.isfile(out / "loss_curve.png")
    assert pushes == [("me/tiny-sft", f"checkpoint-{i}", "train_sft.py") for i in (1, 2, 3)]


@pytest.mark.slow
def test_freeze_input_embeddings_keeps_them_and_trains_the_untied_head(shapes, tmp_path):
    vlm = make_tiny_vlm(str(tmp_path / "untied"), tie_word_embeddings=False)
    start = load_file(os.path.join(vlm, "model.safetensors"))
    embed = next(k for k in start if k.endswith("embed_tokens.weight"))
    head = next(k for k in start if k.endswith("lm_head.weight"))
    assert torch.equal(start[embed], start[head])  # untied, the head starts as a copy
    for freeze in (True, False):
        out = tmp_path / f"freeze-{freeze}"
        main(_config({"qwen2_5_vl": vlm}, shapes, out, max_steps=2, save_steps=2, freeze_input_embeddings=freeze))
        after = load_file(str(out / "checkpoint-2" / "model.safetensors"))
        assert torch.equal(after[embed], start[embed]) is freeze, freeze
        assert not torch.equal(after[head], start[head])  # the head is its own parameter and trains


@pytest.mark.slow
def test_resume_continues_exactly(tiny, shapes, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    main(_config(tiny, shapes, full))
    main(_config(tiny, shapes, resumed, resume_from_checkpoint=str(full / "checkpoint-2")))
    assert not os.path.exists(resumed / "checkpoint-1")  # it started at step 2
    a = load_file(str(full / "checkpoint-3" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoint-3" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _losses(resumed) == _losses(full)[2:]
    state = json.loads((resumed / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["sampler"]["position"] == 12


@pytest.mark.slow
def test_two_processes_match_one_process(tiny, shapes, tmp_path):
    # Same global batch (8 rows x 2 accumulation steps) on 1 process (this one) and on 2 DDP processes: same
    # losses, same gradient norms, so the token-mean over the whole step is normalised the same way.
    args = cli(model_name_or_path=tiny["qwen2_5_vl"], dataset_name=shapes, gradient_accumulation_steps=2,
               max_steps=2, learning_rate=1e-3, save_steps=2, max_length=512, eval_dataset_name=shapes,
               eval_samples=6, eval_max_new_tokens=4, report_to="none")
    main(parse_config(SFTConfig, [*args, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "p1")]))
    finish(launch("train_sft.py", [*args, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "p2")],
                  2, config="cpu"), timeout=300)
    rows = {}
    for n in (1, 2):
        with open(tmp_path / f"p{n}" / "metrics.jsonl") as f:
            rows[n] = [r for r in map(json.loads, f) if "loss" in r]
        assert json.loads((tmp_path / f"p{n}" / "train_summary.json").read_text())["heldout_samples"] == 6
    assert len(rows[1]) == len(rows[2]) == 2
    for a, b in zip(rows[1], rows[2]):
        assert a["tokens"] == b["tokens"]
        assert (a["loss"] == pytest.approx(b["loss"], rel=1e-5)
                and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4))


def test_pure_bf16_weights_at_a_tiny_learning_rate_are_refused_before_training(tiny, shapes, tmp_path):
    from utils.core.errors import InputError

    with pytest.raises(InputError, match=r"--dtype bfloat16 trains .* AdamW at learning rate 1e-06: .*--bf16"):
        main(_config(tiny, shapes, tmp_path, dtype="bfloat16", learning_rate=1e-6))
    assert not os.path.exists(tmp_path / "metrics.jsonl") and not list(tmp_path.glob("checkpoint-*"))


def _launch_sft(config, tiny, shapes, out, *extra, env=None):
    """train_sft.py under `accelerate launch --config_file accelerate_configs/<config>.yaml` on 2 CPU processes
    (fp32: --mixed_precision no), 3 steps at a constant rate, a checkpoint every step."""
    args = [*cli(model_name_or_path=tiny["qwen2_5_vl"], dataset_name=shapes, per_device_train_batch_size=2,
                 max_steps=3, save_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", max_length=512,
                 report_to="none", output_dir=out), *extra]
    run = launch_fsdp2("train_sft.py", args) if config == "fsdp2" else launch("train_sft.py", args, 2, config=config,
                                                                               env=env)
    finish(run, timeout=400)
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def ddp_run(tiny, shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "run"
    return out, _launch_sft("cpu", tiny, shapes, out)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_deepspeed_on_two_cpu_processes_matches_ddp_and_resumes_exactly(tiny, shapes, tmp_path, ddp_run, config):
    from transformers import AutoModelForImageTextToText

    ddp_out, ddp_rows = ddp_run
    env = {"DS_ACCELERATOR": "cpu"}
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rows = _launch_sft(config, tiny, shapes, full, env=env)
    # DeepSpeed really ran, on 2 ranks: its optimizer state is partitioned in two
    shards = os.listdir(full / "checkpoint-3" / "training_state" / "pytorch_model")
    assert sorted(s for s in shards if "optim_states" in s) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)], shards
    assert [r["step"] for r in rows] == [1, 2, 3]
    for ds, ddp in zip(rows, ddp_rows):  # the same global batch and loss normalisation as DDP
        assert ds["tokens"] == ddp["tokens"]
        assert ds["loss"] == pytest.approx(ddp["loss"], rel=1e-5) and ds["grad_norm"] == pytest.approx(
            ddp["grad_norm"], rel=1e-4)
    # the HF copy loads as the DDP run's weights (up to the sharded reductions' rounding)
    ds_model = AutoModelForImageTextToText.from_pretrained(full / "checkpoint-3").state_dict()
    ddp_model = AutoModelForImageTextToText.from_pretrained(ddp_out / "checkpoint-3").state_dict()
    assert ds_model.keys() == ddp_model.keys()
    assert max((ds_model[k] - ddp_model[k]).abs().max().item() for k in ddp_model) < 1e-4
    if config == "zero2":
        return  # resume is the same code for both stages: ZeRO-3 runs it here, ZeRO-2 in train_grpo's test
    again = _launch_sft(config, tiny, shapes, resumed, "--resume_from_checkpoint", str(full / "checkpoint-2"),
                        env=env)
    assert [r["step"] for r in again] == [3] and again[0]["loss"] == rows[2]["loss"]
    a = load_file(str(full / "checkpoint-3" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoint-3" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

@pytest.mark.slow
@pytest.mark.full
def test_fsdp2_on_two_cpu_processes_matches_ddp_and_resumes_exactly(tiny, shapes, tmp_path, ddp_run):
    # accelerate_configs/fsdp2.yaml through tests/fsdp_worker.py (accelerate refuses FSDP on a CPU group otherwise)
    ddp_out, ddp_rows = ddp_run
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    rows = _launch_sft("fsdp2", tiny, shapes, full)
    shards = os.listdir(full / "checkpoint-3" / "training_state" / "pytorch_model_fsdp_0")
    assert sorted(s for s in shards if s.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for fsdp, ddp in zip(rows, ddp_rows):
        assert fsdp["tokens"] == ddp["tokens"]
        assert fsdp["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
        assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4)
    a = load_file(str(ddp_out / "checkpoint-3" / "model.safetensors"))
    b = load_file(str(full / "checkpoint-3" / "model.safetensors"))
    assert a.keys() ^ b.keys() <= {"lm_head.weight"}  # DDP's names; the gathered copy may write the tied head too
    assert max((a[k] - b[k]).abs().max().item() for k in a.keys() & b.keys()) < 1e-4
    again = _launch_sft("fsdp2", tiny, shapes, resumed, "--resume_from_checkpoint", str(full / "checkpoint-2"))
    assert [r["step"] for r in again] == [3] and again[0]["loss"] == rows[2]["loss"]
    c = load_file(str(resumed / "checkpoint-3" / "model.safetensors"))
    assert c.keys() == b.keys() and all(torch.equal(b[k], c[k]) for k in b)
