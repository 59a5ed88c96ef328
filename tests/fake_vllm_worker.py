"""train_grpo.py --use_vllm with tests/vllm_helpers.py's fake engine standing in for vLLM (no GPU needed), for
`accelerate launch` with several processes. Each process then writes what its engine saw to
<output_dir>/engine-<rank>.json: the rendezvous variables it was built under, its calls, the seeds it sampled."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.vllm_helpers import FakeVLLM  # noqa: E402

sys.modules["vllm"] = FakeVLLM

import train_grpo  # noqa: E402
import utils.core.vllm_rollout  # noqa: E402
from utils.core.config import parse_config  # noqa: E402


def require_vllm():  # the real import, without the CUDA check
    import vllm

    return vllm


if __name__ == "__main__":
    utils.core.vllm_rollout.require_vllm = train_grpo.require_vllm = require_vllm
    cfg = parse_config(train_grpo.GRPOConfig, sys.argv[1:])
    train_grpo.main(cfg)
    (engine,) = FakeVLLM.engines
    record = dict(env=engine.env, calls=[c[0] for c in engine.calls], synced=len(engine.model.loaded),
                  seeds=[p.seed for p in engine.all_params], tp=engine.kwargs["tensor_parallel_size"],
                  engine_seed=engine.kwargs["seed"])
    with open(os.path.join(cfg.output_dir, f"engine-{engine.env['RANK']}.json"), "w") as f:
        json.dump(record, f)
