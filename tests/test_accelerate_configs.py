import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "accelerate_configs"

# name -> (distributed_type, num_processes, num_machines, zero_stage, optimizer offload, param offload)
EXPECTED = {
    "cpu": (DistributedType.MULTI_GPU, 2, 1, None, None, None),  # torchrun launcher; workers run on CPU
    "single_gpu": (DistributedType.NO, 1, 1, None, None, None),
    "ddp": (DistributedType.MULTI_GPU, 8, 1, None, None, None),
    "zero2": (DistributedType.DEEPSPEED, 8, 1, 2, "none", "none"),
    "zero3": (DistributedType.DEEPSPEED, 8, 1, 3, "none", "none"),
    "zero3_offload": (DistributedType.DEEPSPEED, 8, 1, 3, "cpu", "cpu"),
    "multinode_zero3": (DistributedType.DEEPSPEED, 16, 2, 3, "none", "none"),
    "fsdp2": (DistributedType.FSDP, 8, 1, None, None, None),
}
DEEPSPEED_CONFIGS = [name for name, spec in EXPECTED.items() if spec[3] is not None]
# deepspeed_config keys that `accelerate launch` hands to DeepSpeedPlugin (deepspeed_multinode_launcher is
# for the launcher itself)
PLUGIN_KEYS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_init_flag",
               "zero3_save_16bit_model", "gradient_accumulation_steps", "gradient_clipping",
               "offload_optimizer_nvme_path", "offload_param_nvme_path")


def test_the_config_folder_holds_exactly_the_documented_configs():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerates_own_loader(name):
    cfg = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    assert isinstance(cfg, ClusterConfig)
    distributed_type, num_processes, num_machines, zero_stage, offload_opt, offload_param = EXPECTED[name]
    assert cfg.distributed_type == distributed_type
    assert (cfg.num_processes, cfg.num_machines) == (num_processes, num_machines)
    assert cfg.use_cpu == (name == "cpu")
    if zero_stage is None:
        assert not cfg.deepspeed_config
        return
    ds = cfg.deepspeed_config
    assert ds["zero_stage"] == zero_stage
    assert (ds["offload_optimizer_device"], ds["offload_param_device"]) == (offload_opt, offload_param)
    assert ds["deepspeed_multinode_launcher"] == "standard"
    # left out so the script's Accelerator settings fill them ("auto")
    assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds
    if zero_stage == 3:
        assert ds["zero3_init_flag"] is True and ds["zero3_save_16bit_model"] is True


def test_multinode_placeholders_are_marked_for_the_user():
    lines = (CONFIGS / "multinode_zero3.yaml").read_text().splitlines()
    for key in ("main_process_ip:", "main_process_port:", "machine_rank:"):
        line = next(line for line in lines if line.startswith(key))
        assert "# FILL IN" in line, line
    cfg = load_config_from_file(str(CONFIGS / "multinode_zero3.yaml"))
    assert cfg.machine_rank == 0 and isinstance(cfg.main_process_port, int)


def _no_auto_left(node, where=""):
    if isinstance(node, dict):
        for key, value in node.items():
            _no_auto_left(value, f"{where}.{key}")
    else:
        assert node != "auto", f"{where} is still 'auto'"


def deepspeed_json(name, *, micro_batch=2, grad_accum=4, hidden_size=64):
    """The DeepSpeed config accelerate would hand to deepspeed.initialize for this YAML on one process."""
    from accelerate.utils import DeepSpeedPlugin

    cfg = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    plugin = DeepSpeedPlugin(**{k: v for k, v in cfg.deepspeed_config.items() if k in PLUGIN_KEYS})
    plugin.set_mixed_precision(cfg.mixed_precision)
    # what Accelerator._prepare_deepspeed fills in for "auto" entries
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=grad_accum)
    plugin.deepspeed_config_process(must_match=False, **{
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": micro_batch,
        "train_batch_size": micro_batch * grad_accum,  # x world size 1
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    })
    return plugin, plugin.deepspeed_config


@pytest.mark.parametrize("name", DEEPSPEED_CONFIGS)
def test_deepspeed_section_is_accepted_by_deepspeed(name, monkeypatch):
    for key in list(os.environ):
        if key.startswith("ACCELERATE_"):  # the plugin reads launcher env vars; keep the YAML the only source
            monkeypatch.delenv(key)
    from deepspeed.runtime.config import DeepSpeedConfig

    plugin, ds_json = deepspeed_json(name)
    _no_auto_left(ds_json)
    parsed = DeepSpeedConfig(json.loads(json.dumps(ds_json)))  # through JSON, as a config file would be
    _, _, _, zero_stage, offload_opt, offload_param = EXPECTED[name]
    assert parsed.zero_optimization_stage == zero_stage
    assert parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.gradient_accumulation_steps == 4 and parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.gradient_clipping == 1.0
    zero = parsed.zero_config
    optimizer_device = zero.offload_optimizer.device if zero.offload_optimizer else "none"
    param_device = zero.offload_param.device if zero.offload_param else "none"
    assert (str(getattr(optimizer_device, "value", optimizer_device)),
            str(getattr(param_device, "value", param_device))) == (offload_opt, offload_param)
    if zero_stage == 3:
        assert zero.gather_16bit_weights_on_model_save  # what utils.core.checkpoint needs for the HF copy
        assert plugin.zero3_init_flag


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.full
def test_two_process_ddp_launch_on_cpu(tmp_path):
    accelerate_bin = Path(sys.executable).parent / "accelerate"
    result = tmp_path / "ddp_result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [str(accelerate_bin), "launch", "--config_file", str(CONFIGS / "cpu.yaml"),
           "--main_process_port", str(_free_port()), str(REPO / "tests" / "ddp_smoke.py"), str(result)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(result.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert len(report["steps"]) == 2
    for step in report["steps"]:
        assert len(step["losses"]) == 2 and step["losses"][0] != step["losses"][1]  # ranks saw different data
    # the job resumed from its own checkpoint and reproduced the same per-rank losses (asserted in the job)
    assert len(report["resumed_losses"]) == 2
    checkpoint = tmp_path / "run" / "checkpoint-2" / "training_state"
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [3, 4]  # written once, by rank 0 only


# ----------------------------------------------------------------------------------------------
# FSDP2 (accelerate_configs/fsdp2.yaml)
# ----------------------------------------------------------------------------------------------


def fsdp2_plugin(monkeypatch):
    """The FSDP plugin accelerate builds in each worker from fsdp2.yaml (the launcher turns fsdp_config into FSDP_*
    variables, the plugin reads them)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp = load_config_from_file(str(CONFIGS / "fsdp2.yaml")).fsdp_config
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for key, value in fsdp.items():
        monkeypatch.setenv(key.upper(), str(value).lower() if isinstance(value, bool) else str(value))
    return FullyShardedDataParallelPlugin()


def test_fsdp2_config_is_full_sharding_with_activation_checkpointing(monkeypatch):
    plugin = fsdp2_plugin(monkeypatch)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # FSDP2's full sharding
    assert plugin.activation_checkpointing is True and plugin.cpu_offload.__class__.__name__ == "OffloadPolicy"
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.transformer_cls_names_to_wrap is None  # the model's own layer classes (utils/core/fsdp.py)
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading is False


def documented_layer_classes():
    """family -> the classes fsdp2.yaml's comment lists (`#   Family: Class, Class`)."""
    table = {}
    for line in (CONFIGS / "fsdp2.yaml").read_text().splitlines():
        if line.startswith("#   ") and ": " in line:
            family, classes = line[4:].split(": ", 1)
            table[family] = {c.split(" (")[0].strip() for c in classes.split(",")}
    return table


FAMILY_ROWS = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen3_5": "Qwen3.5", "glm4v": "GLM-4.1V",
               "internvl": "InternVL", "gemma3": "Gemma 3"}


@pytest.mark.parametrize("family", sorted(FAMILY_ROWS))
def test_fsdp2_units_are_each_familys_layer_classes(family_models, monkeypatch, family):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from utils.core.fsdp import fsdp_layer_classes
    from utils.core.logprobs import CompletionLogProbs

    model, _ = family_models(family)
    policy = CompletionLogProbs(model)
    classes = fsdp_layer_classes(policy)
    # the model's own list names classes this checkpoint may lack; accelerate refuses a name it cannot find
    assert set(classes) <= set(model._no_split_modules) and set(classes) >= documented_layer_classes()[
        FAMILY_ROWS[family]]
    plugin = fsdp2_plugin(monkeypatch)
    policy._no_split_modules = classes  # what prepare_training sets under FSDP
    plugin.set_auto_wrap_policy(policy)
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, policy)
    units = [m for m in policy.modules() if wrap(m)]
    decoder = [m for m in units if "Decoder" in type(m).__name__]
    assert len(decoder) == model.config.get_text_config().num_hidden_layers  # every decoder layer is a unit
    assert any("Vision" in type(m).__name__ or "Siglip" in type(m).__name__ for m in units)
    del policy._no_split_modules  # without it accelerate finds no class on our wrapper: one unit, the whole model
    plugin = fsdp2_plugin(monkeypatch)
    plugin.set_auto_wrap_policy(policy)
    assert not any(fsdp2_prepare_auto_wrap_policy(plugin, policy)(m) for m in policy.modules())


def test_fsdp_units_are_set_and_double_activation_checkpointing_is_refused():
    from types import SimpleNamespace

    import torch

    from utils.core.config import ConfigError
    from utils.core.run import prepare_training

    class Prepared(RuntimeError):
        pass

    def prepare(model, optimizer):
        raise Prepared(model._no_split_modules)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0]._no_split_modules = ["Linear", "Missing"]
    plugin = SimpleNamespace(activation_checkpointing=True)
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, prepare=prepare,
                                  state=SimpleNamespace(fsdp_plugin=plugin, deepspeed_plugin=None))
    cfg = SimpleNamespace(learning_rate=1e-3, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0,
                          gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="--gradient_checkpointing: the FSDP config's fsdp_activation_checkpointing"):
        prepare_training(accelerator, cfg, model, list(model.parameters()), max_steps=1, num_warmup_steps=0,
                         micro_batch_size=1)
    cfg.gradient_checkpointing = False
    with pytest.raises(Prepared, match=r"\['Linear'\]"):  # the classes the model holds, on the prepared module
        prepare_training(accelerator, cfg, model, list(model.parameters()), max_steps=1, num_warmup_steps=0,
                         micro_batch_size=1)


def test_adamw_state_filled_up_front_gives_the_same_updates():
    # a parameter reached only at step 2 (the tower in Mix-GRPO before its first reflect step): AdamW's state made
    # at prepare time (utils/core/fsdp.py, for FSDP checkpoints) gives the updates of its lazy state exactly
    import torch

    from utils.core.fsdp import init_adamw_state

    def run(prefill):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
        opt = torch.optim.AdamW([a, b], lr=0.1, weight_decay=0.01)
        if prefill:
            init_adamw_state(opt)
            assert len(opt.state) == 2 and opt.state[b]["step"].item() == 0
        for step in range(3):
            loss = (a ** 2).sum() + ((b ** 3).sum() if step > 0 else 0)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return a.detach().clone(), b.detach().clone(), opt.state[b]["step"].item()

    lazy, filled = run(False), run(True)
    assert torch.equal(lazy[0], filled[0]) and torch.equal(lazy[1], filled[1]) and lazy[2] == filled[2] == 2
    with pytest.raises(ValueError, match="SGD is not AdamW"):
        init_adamw_state(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
