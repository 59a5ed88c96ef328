"""Checkpoints from elsewhere run no code under every engine, on 2 launched CPU processes: a pickle planted in each
pickled file of training_state/ (DeepSpeed's own engine files included) is refused, naming the file, with or without
the manifest (tests/checkpoint_worker.py). ZeRO-3 in the fast tier (DeepSpeed unpickles its engine files itself);
DDP and ZeRO-2 in the full tier."""

import json

import pytest

from tests.launch_helpers import finish, launch

EXPECTED = {
    "ddp": {"custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"},
    "zero2": {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl",
              "pytorch_model/mp_rank_00_model_states.pt",
              "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"},
    "zero3": {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl",
              "pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt",
              "pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt",
              "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"},
}


@pytest.mark.slow
@pytest.mark.full  # the fast tier checks every file in-process (tests/test_reliability.py)
@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3"])
def test_a_pickle_planted_in_any_training_state_file_is_refused_under_every_engine(tmp_path, engine):
    out = tmp_path / "result.json"
    if engine == "ddp":
        proc = launch("tests/checkpoint_worker.py", [str(tmp_path / "run"), str(out)], num_processes=2)
    else:
        proc = launch("tests/checkpoint_worker.py", [str(tmp_path / "run"), str(out)], num_processes=2,
                      config=engine, env={"DS_ACCELERATOR": "cpu"})
    finish(proc, timeout=900, what=f"tests/checkpoint_worker.py under {engine}")
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and set(result["files"]) == EXPECTED[engine]
    assert not result["pwned"]  # no planted pickle ran, under any engine
    for name in result["files"]:
        with_manifest, without = result["refusals"][f"{name} manifest=True"], result["refusals"][f"{name} "
                                                                                                  "manifest=False"]
        assert with_manifest and f"training_state/{name}: its sha256 differs" in with_manifest, (name, with_manifest)
        assert without and f"training_state/{name}: refused, it holds more than tensors" in without, (name, without)
    assert result["resumed"] == 1  # and the checkpoint as saved resumes
