import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from utils.core.checkpoint import latest_checkpoint, load_checkpoint, resolve_resume, save_checkpoint
from utils.core.samplers import SeededSampler

torch.set_num_threads(1)
DATA = torch.linspace(-1, 1, 40 * 4).reshape(40, 4)
TARGET = DATA.sum(dim=1, keepdim=True).sin()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 32)
        self.drop = torch.nn.Dropout(0.5)  # draws from the torch RNG every step
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def build(seed):
    set_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, SeededSampler(len(DATA), seed=7)


def train(accelerator, model, optimizer, scheduler, sampler, steps):
    losses = []
    for _ in range(steps):
        idx = sampler.take(6)
        # noise from torch, numpy and python RNGs: all three must be restored for the losses to match
        x = DATA[idx] + 0.1 * torch.randn(6, 4) + float(np.random.rand()) * 0.1 + random.random() * 0.1
        loss = torch.nn.functional.mse_loss(model(x), TARGET[idx])
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_resume_reproduces_losses_exactly(tmp_path):
    accelerator, model, optimizer, scheduler, sampler = build(seed=0)
    train(accelerator, model, optimizer, scheduler, sampler, 3)
    path = save_checkpoint(accelerator, tmp_path, 3, model=model,
                           extra_state={"sampler": sampler.state_dict(), "stage": "phase1",
                                        "metrics": {"reward": torch.tensor(0.5)}})
    expected = train(accelerator, model, optimizer, scheduler, sampler, 3)
    expected_lr = scheduler.get_last_lr()

    # a fresh run: different init weights, different RNG, sampler at the start
    accelerator, model, optimizer, scheduler, sampler = build(seed=123)
    state = load_checkpoint(accelerator, path)
    assert state["global_step"] == 3 and state["stage"] == "phase1" and state["metrics"]["reward"] == 0.5
    sampler.load_state_dict(state["sampler"])
    assert train(accelerator, model, optimizer, scheduler, sampler, 3) == expected
    assert scheduler.get_last_lr() == expected_lr

    # the same weights/optimizer/sampler with *other* RNG states give other losses: the RNG restore matters
    accelerator, model, optimizer, scheduler, sampler = build(seed=123)
    state = load_checkpoint(accelerator, path)
    sampler.load_state_dict(state["sampler"])
    set_seed(99)
    assert train(accelerator, model, optimizer, scheduler, sampler, 3) != expected


def test_checkpoint_layout_and_hf_copy(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    set_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>"] + [f"w{i}" for i in range(30)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")
    class Policy(torch.nn.Module):  # a script's wrapper around the HF model: the HF copy is of the inner one
        def __init__(self):
            super().__init__()
            self.temperature = torch.nn.Parameter(torch.ones(()))
            self.model = LlamaForCausalLM(config)

    accelerator = Accelerator(cpu=True)
    model = Policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    path = Path(save_checkpoint(accelerator, tmp_path, 5, model=model, processor=tokenizer))
    assert path == tmp_path / "checkpoint-5"
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.json", "training_state"} <= names
    training_state = {p.name for p in (path / "training_state").iterdir()}
    assert {"optimizer.bin", "random_states_0.pkl"} <= training_state
    assert json.loads((path / "trainer_state.json").read_text())["global_step"] == 5

    reloaded = LlamaForCausalLM.from_pretrained(path)
    for name, tensor in accelerator.unwrap_model(model).model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert PreTrainedTokenizerFast.from_pretrained(path).convert_tokens_to_ids("w3") == vocab["w3"]


class CrashingProcessor:
    """Writes part of its files, then fails, like a full disk or a killed job in the middle of a save."""

    def save_pretrained(self, folder):
        Path(folder, "tokenizer_config.json").write_text("{")
        raise OSError("disk full")


def _tiny_prepared():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model


def test_crash_mid_save_leaves_no_checkpoint(tmp_path):
    accelerator, model = _tiny_prepared()
    save_checkpoint(accelerator, tmp_path, 1, model=model)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(accelerator, tmp_path, 2, model=model, processor=CrashingProcessor())
    assert not (tmp_path / "checkpoint-2").exists()
    assert (tmp_path / ".tmp-checkpoint-2").is_dir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1")
    assert resolve_resume("latest", tmp_path) == str(tmp_path / "checkpoint-1")

    save_checkpoint(accelerator, tmp_path, 3, model=model)  # the next save cleans the leftover up
    assert not list(tmp_path.glob(".tmp-checkpoint-*"))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")


def test_save_total_limit_prunes_oldest_and_resave_replaces(tmp_path):
    accelerator, model = _tiny_prepared()
    for step in (10, 2, 30):  # numeric order, not creation or string order
        save_checkpoint(accelerator, tmp_path, step, model=model, extra_state={"tag": step})
    save_checkpoint(accelerator, tmp_path, 40, model=model, save_total_limit=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-30", "checkpoint-40"]

    save_checkpoint(accelerator, tmp_path, 40, model=model, extra_state={"tag": "again"}, save_total_limit=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-40"]
    assert json.loads((tmp_path / "checkpoint-40" / "trainer_state.json").read_text())["tag"] == "again"
    with pytest.raises(ValueError, match="save_total_limit"):
        save_checkpoint(accelerator, tmp_path, 41, model=model, save_total_limit=0)
    assert not (tmp_path / "checkpoint-41").exists() and not list(tmp_path.glob(".tmp-*"))


def test_save_total_limit_never_deletes_a_kept_checkpoint(tmp_path):
    # --load_best_model_at_end keeps the best so far beside the limit, as HF's Trainer does
    accelerator, model = _tiny_prepared()
    for step in (1, 2, 3):
        save_checkpoint(accelerator, tmp_path, step, model=model)
    save_checkpoint(accelerator, tmp_path, 4, model=model, save_total_limit=1, keep=[tmp_path / "checkpoint-2"])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    save_checkpoint(accelerator, tmp_path, 5, model=model, save_total_limit=2, keep=[str(tmp_path / "checkpoint-2")])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]


def test_resolve_resume(tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("latest", tmp_path) is None  # first run: nothing to resume yet
    missing = tmp_path / "checkpoint-9"
    with pytest.raises(FileNotFoundError, match="checkpoint-9"):
        resolve_resume(str(missing), tmp_path)
    (tmp_path / "checkpoint-8").mkdir()  # a folder copied by hand, without trainer state
    with pytest.raises(ValueError, match="checkpoint-8.*not a complete checkpoint"):
        resolve_resume(str(tmp_path / "checkpoint-8"), tmp_path)
    assert latest_checkpoint(tmp_path) is None

    accelerator, model = _tiny_prepared()
    path = save_checkpoint(accelerator, tmp_path, 4, model=model)
    assert resolve_resume(path, tmp_path) == path
    assert resolve_resume("latest", tmp_path) == path


def test_seeded_sampler_epochs_and_state():
    sampler = SeededSampler(5, seed=3)
    first = sampler.take(12)
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:10]) == list(range(5))
    assert first[:5] != first[5:10]  # a fresh permutation per epoch
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 2

    again = SeededSampler(5, seed=3)
    assert again.take(12) == first  # reproducible from the seed
    resumed = SeededSampler(5, seed=3)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.take(7) == sampler.take(7)
    assert SeededSampler(4, seed=0, shuffle=False).take(6) == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="num_items"):
        SeededSampler(6, seed=3).load_state_dict(sampler.state_dict())


def test_sampler_registered_for_checkpointing_is_restored(tmp_path):
    accelerator, model = _tiny_prepared()
    sampler = SeededSampler(10, seed=1)
    accelerator.register_for_checkpointing(sampler)
    sampler.take(13)
    path = save_checkpoint(accelerator, tmp_path, 1, model=model)
    upcoming = sampler.take(4)

    accelerator, model = _tiny_prepared()
    fresh = SeededSampler(10, seed=1)
    accelerator.register_for_checkpointing(fresh)
    load_checkpoint(accelerator, path)
    assert fresh.take(4) == upcoming
