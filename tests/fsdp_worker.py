"""Run a train script under accelerate_configs/fsdp2.yaml on CPU processes (gloo):

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 --mixed_precision no \
        tests/fsdp_worker.py train_grpo.py [its flags]

accelerate 1.15 turns FSDP on only for GPU-family process groups: `AcceleratorState.__init__` (state.py, the branch
of MULTI_GPU, MULTI_XPU, ...) sets `distributed_type = FSDP`, and a CPU group stays MULTI_CPU with the FSDP plugin
dropped. This worker lifts exactly that gate (the plugin accelerate built from the config is kept and the type set
to FSDP); everything after it is accelerate's own FSDP2 path: fully_shard per layer class, activation checkpointing,
DTensor gradients and clipping, sharded checkpoints through torch.distributed.checkpoint, and the script's code."""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import accelerate.state  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

_init = accelerate.state.AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # the process state too: every later AcceleratorState() copies its fields back over the accelerator's
        accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


if __name__ == "__main__":
    assert os.environ.get("ACCELERATE_USE_FSDP") == "true", "launch with accelerate_configs/fsdp2.yaml"
    accelerate.state.AcceleratorState.__init__ = _init_with_fsdp_on_cpu
    script = os.path.join(REPO, sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    runpy.run_path(script, run_name="__main__")
