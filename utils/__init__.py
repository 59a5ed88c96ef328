"""What the scripts share, in three wings:

    utils/core/   GRPO and SFT: the run skeleton, config, data, models, rollout, log-probs, losses, checkpoints
    utils/t2i/    text-to-image (Mix-GRPO): the flow SDE step, generators and their adapters, the Mix-GRPO policy,
                  its evaluation, prompt sets, R3's prompt format
    utils/eval/   scoring: held-out generation, grading, benchmarks, distilled chains, reasoning keywords

The modules used to sit flat in utils/ (utils.losses, utils.flow.sde, ...). Those names still import, as the very
same module objects, so code written against them keeps working (and monkeypatching either name patches both).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_CORE = ("checkpoint compiled_generation config curriculum data data_checks data_sources encoding errors groups hub "
         "importance launch logprobs losses models packed_attention packing pcgrad precision prompts reward_calls "
         "rollout run samplers seeds serving sft_data tracking video vllm_rollout zero3").split()
MOVED = {f"utils.{name}": f"utils.core.{name}" for name in _CORE}
MOVED.update({
    "utils.flow": "utils.t2i", "utils.flow.sde": "utils.t2i.sde", "utils.flow.generators": "utils.t2i.generators",
    "utils.flow.qwen_image": "utils.t2i.qwen_image", "utils.flow.adapters": "utils.t2i.adapters",
    "utils.mixgrpo_model": "utils.t2i.mixgrpo_model", "utils.mixgrpo_eval": "utils.t2i.mixgrpo_eval",
    "utils.t2i_data": "utils.t2i.data", "utils.r3_format": "utils.t2i.r3_format",
    "utils.evaluation": "utils.eval.heldout", "utils.grading": "utils.eval.grading",
    "utils.benchmarks": "utils.eval.benchmarks", "utils.chains": "utils.eval.chains",
    "utils.keywords": "utils.eval.keywords",
})


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old flat name as the module now at its new place (one module object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == "utils.flow")

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system is about to set the alias's spec on the module
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # put the module's own spec back; its code ran on import


# first on the path: the old name must not be found again as a fresh copy of the file through its new package
if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
