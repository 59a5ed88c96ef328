"""Two-process DDP smoke job, run by tests/test_accelerate_configs.py through `accelerate launch`.

Each rank trains a tiny model for 2 steps on *different* data, checks that world size is 2 and that after
DDP's all-reduce every rank holds the same gradient: the mean of the ranks' local gradients. Then it saves a
checkpoint with utils.core.checkpoint, trains 2 more steps with per-rank noise, reloads the checkpoint and checks
that the same 2 steps come out again on every rank (per-rank RNG restore), and logs through utils.core.tracking.
Rank 0 writes a JSON result to the path given as the first argument (the run folder is next to it).
"""

import copy
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from utils.core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from utils.core.samplers import SeededSampler
from utils.core.tracking import RunLogger


def flat_grad(module):
    return torch.cat([p.grad.detach().flatten() for p in module.parameters()])


def main(result_path):
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    world = accelerator.num_processes
    assert world == 2, f"expected 2 processes, got {world}"
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 2
    set_seed(0)  # same init on both ranks (DDP would broadcast rank 0's weights anyway)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    report = {"world_size": world, "backend": torch.distributed.get_backend(), "steps": []}
    for step in range(2):
        generator = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
        x = torch.randn(8, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True)

        # the gradient this rank would have alone, from a plain copy outside DDP
        local = copy.deepcopy(accelerator.unwrap_model(model))
        torch.nn.functional.mse_loss(local(x), y).backward()
        local_grad = flat_grad(local)

        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        synced = flat_grad(model)

        all_synced = accelerator.gather(synced[None])
        all_local = accelerator.gather(local_grad[None])
        all_losses = accelerator.gather(loss.detach()[None])
        assert torch.equal(all_synced[0], all_synced[1]), "ranks hold different gradients after all-reduce"
        assert not torch.allclose(all_local[0], all_local[1]), "ranks saw the same data: the test proves nothing"
        assert torch.allclose(synced, all_local.mean(dim=0), atol=1e-6), "all-reduced gradient is not the mean"
        optimizer.step()
        optimizer.zero_grad()
        report["steps"].append({"losses": all_losses.tolist(), "grad_norm": synced.norm().item()})

    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    all_params = accelerator.gather(params[None])
    assert torch.equal(all_params[0], all_params[1]), "ranks diverged"

    # checkpoint + resume under DDP: every rank draws different noise, so each rank's RNG must come back
    run_dir = os.path.join(os.path.dirname(os.path.abspath(result_path)), "run")
    set_seed(42, device_specific=True)
    sampler = SeededSampler(16, seed=3)
    logger = RunLogger(run_dir, accelerator, report_to="none", total_steps=4, start_step=2)

    def noisy_steps(n):
        losses = []
        for _ in range(n):
            idx = torch.tensor(sampler.take(4))
            x = idx[:, None].float().repeat(1, 4) / 16 + 0.1 * torch.randn(4, 4)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()[None]).tolist())
        return losses

    path = save_checkpoint(accelerator, run_dir, 2, model=model, extra_state={"sampler": sampler.state_dict()})
    assert latest_checkpoint(run_dir) == path
    assert os.path.isfile(os.path.join(path, "training_state", f"random_states_{accelerator.process_index}.pkl"))
    first = noisy_steps(2)
    for step, losses in enumerate(first, start=3):
        logger.log(step, {"loss": sum(losses) / len(losses)})
    logger.close()

    set_seed(7)  # scramble every rank's RNG before the resume
    sampler = SeededSampler(16, seed=3)
    state = load_checkpoint(accelerator, path)
    sampler.load_state_dict(state["sampler"])
    again = noisy_steps(2)
    assert again == first, f"resume did not reproduce the steps: {first} vs {again}"
    report["resumed_losses"] = again

    if accelerator.is_main_process:
        with open(result_path, "w") as handle:
            json.dump(report, handle)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
