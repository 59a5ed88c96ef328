"""Launched by tests/test_reliability_launch.py under an engine (DDP, ZeRO-2, ZeRO-3) on 2 CPU processes: save a
checkpoint, then plant a code-running pickle in each of its pickled files in turn (with the manifest, and without
it) and try to resume; every refusal goes to OUT_JSON.

    accelerate launch ... tests/checkpoint_worker.py OUTPUT_DIR OUT_JSON
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils.core.launch import relaunch_multi_cpu_if_needed  # noqa: E402

relaunch_multi_cpu_if_needed()

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

from utils.core.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from utils.core.checkpoint_files import MANIFEST_NAME, UnsafeCheckpointError, pickled_files  # noqa: E402
from utils.core.launch import accelerator_device_kwargs  # noqa: E402


class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').write('pwned')",)


out_dir, out_json = sys.argv[1], sys.argv[2]
accelerator = Accelerator(**accelerator_device_kwargs())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
plugin = accelerator.state.deepspeed_plugin
if plugin is not None:
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    plugin.deepspeed_config["gradient_clipping"] = 1.0
model, optimizer = accelerator.prepare(model, optimizer)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
accelerator.register_for_checkpointing(scheduler)
accelerator.backward(model(torch.randn(2, 4)).pow(2).mean())
optimizer.step()
optimizer.zero_grad()
path = save_checkpoint(accelerator, out_dir, 1, model=model)
state = os.path.join(path, "training_state")
files = [str(p.relative_to(state)) for p in pickled_files(state)]
marker = os.path.join(out_dir, "pwned")
refusals = {}
for name in files:
    for manifest in (True, False):
        file, clean = os.path.join(state, name), os.path.join(out_dir, "clean")  # the clean copy: outside the state
        if accelerator.is_main_process:
            shutil.copy(file, clean)
            shutil.copy(os.path.join(state, MANIFEST_NAME), os.path.join(out_dir, "manifest.clean"))
            if not manifest:
                os.remove(os.path.join(state, MANIFEST_NAME))
            torch.save({"state": Boom(marker)}, file)
        accelerator.wait_for_everyone()
        try:
            load_checkpoint(accelerator, path)
            refusals[f"{name} manifest={manifest}"] = None
        except UnsafeCheckpointError as refusal:
            refusals[f"{name} manifest={manifest}"] = str(refusal)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            os.replace(clean, file)
            shutil.copy(os.path.join(out_dir, "manifest.clean"), os.path.join(state, MANIFEST_NAME))
        accelerator.wait_for_everyone()
resumed = load_checkpoint(accelerator, path)["global_step"]  # the clean checkpoint: its own files pass both checks
if accelerator.is_main_process:
    with open(out_json, "w") as f:
        json.dump({"files": files, "refusals": refusals, "pwned": os.path.exists(marker), "resumed": resumed,
                   "processes": accelerator.num_processes}, f, indent=1)
accelerator.wait_for_everyone()
accelerator.end_training()
sys.stdout.flush()
os._exit(0)  # the result is written; the interpreter's own teardown of DeepSpeed's gloo group can abort a rank
