"""Run under torchrun with 2 CPU processes: ZeRO-3 sharded generation and log-probs equal the unsharded model.

    python -m torch.distributed.run --nproc_per_node 2 tests/zero3_worker.py MODEL_DIR OUT_JSON
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_grad

from tiny.shapes import make_shapes_vqa
from utils.core.encoding import encode_prompts
from utils.core.logprobs import CompletionLogProbs
from utils.core.models import load_model_and_processor  # noqa: E402
from utils.core.prompts import build_messages  # noqa: E402
from utils.core.rollout import generate_completions
from utils.core.seeds import completion_seeds
from utils.core.zero3 import zero3_gathered

model_dir, out_path = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)

rows = [make_shapes_vqa(2, seed=3)[i] for i in range(2)]
reference, processor = load_model_and_processor(model_dir)
tok = processor.tokenizer
batch = encode_prompts(processor, [build_messages(r["question"]) for r in rows], [[r["image"]] for r in rows],
                       sample_ids=[r["id"] for r in rows])
gen = dict(row_seeds=completion_seeds(0, 0, [2 * rank, 2 * rank + 1]), max_new_tokens=10, temperature=1.0,
           eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
expected_ids, expected_mask = generate_completions(reference, batch, **gen)
with torch.no_grad():
    expected_logps = CompletionLogProbs(reference)(batch, expected_ids, expected_mask)

config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
sharded, _ = load_model_and_processor(model_dir)  # the ZeRO-3 engine partitions it on initialize
policy = CompletionLogProbs(sharded)
engine, *_ = deepspeed.initialize(model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.1), config=config)
local_numel = sum(p.numel() for p in engine.module.parameters())  # partitioned: 0-sized local views
with zero3_gathered(engine) as module:
    full_numel = sum(p.numel() for p in module.parameters())
    ids, mask = generate_completions(module.model, batch, **gen)


def logps_and_grads(padding_free):
    """The sharded log-probs and the full gradients (gathered from the shards) of the mean completion NLL."""
    engine.module.padding_free = padding_free  # packed: utils/core/packing.py under the gathered ZeRO-3 weights
    logps = engine(batch, ids, mask)
    engine.backward(-(logps * mask).sum() / mask.sum())
    grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    return logps, grads


padded_logps, padded_grads = logps_and_grads(False)
engine.optimizer.zero_grad()
logps, grads = logps_and_grads(True)  # this one trains
engine.step()
largest = max(g.abs().max() for g in padded_grads.values())
grad_diff = max(((grads[n] - g).abs().max() / torch.maximum(g.abs().max(), 1e-4 * largest)).item()
                for n, g in padded_grads.items())
with torch.no_grad():
    after = engine(batch, ids, mask)

result = dict(rank=rank, same_ids=torch.equal(ids, expected_ids),
              max_logp_diff=(padded_logps.detach() - expected_logps).abs().max().item(),
              max_packed_logp_diff=(logps.detach() - expected_logps).abs().max().item(),
              packed_grad_rel_diff=grad_diff, grads=len(padded_grads),
              moved=(after - logps.detach()).abs().max().item(), local_numel=local_numel, full_numel=full_numel)
with open(f"{out_path}.{rank}", "w") as f:
    json.dump(result, f)
