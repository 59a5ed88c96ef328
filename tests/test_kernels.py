"""kernels/: every path against a float64 naive reference, forward and gradients, on awkward shapes.

The torch path runs here. The Triton path runs compiled on CUDA, or, on a CPU-only machine, in a
subprocess with TRITON_INTERPRET=1 (the variable must be set before triton is imported):
test_interpreter_suite re-runs the `triton` cases of this file and of test_kernel_precision.py that way.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import kernels.logprob as logprob
from kernels import fused_token_logprobs, group_advantages, token_logprobs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
TRITON_HERE = logprob.triton is not None and (HAS_CUDA or INTERPRET)
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_HERE, reason="Triton runs on CUDA, or in test_interpreter_suite's TRITON_INTERPRET=1 subprocess"))]
V, H = 100, 24  # V is not a multiple of the 32-column test tile


def device_for(backend):
    return "cuda" if backend == "triton" and HAS_CUDA and not INTERPRET else "cpu"


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # 32-column tiles and 3-row chunks: several tiles, a ragged last tile, several row chunks
    for prefix in ("", "CUDA_"):
        monkeypatch.setattr(logprob, prefix + "VOCAB_TILE", 32)
        monkeypatch.setattr(logprob, prefix + "TILE_ELEMENTS", 32 * 3)


def reference(hidden, weight, labels, bias=None, temperature=1.0, ignore_index=-100):
    """float64 log p(label) and entropy from the full logits."""
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    keep = labels != ignore_index
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    entropy = -(logp_all.exp() * logp_all).sum(-1) * keep
    return logp, entropy


def grads_of(outputs, upstreams, params):
    loss = sum((o.double() * u).sum() for o, u in zip(outputs, upstreams))
    return torch.autograd.grad(loss, params, allow_unused=True)


def assert_close(actual, expected, tol, what):
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.double().abs().max().item() if expected.numel() else 1.0)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol * scale:.3g}"


def make_case(shape, *, dtype=torch.float32, bias=False, trainable=True, ignore=(), seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_(trainable)
    b = (torch.randn(V, generator=gen)).to(device=device, dtype=dtype).requires_grad_(trainable) if bias else None
    labels = torch.randint(0, V, shape, generator=gen)
    for position in ignore:
        labels.view(-1)[position] = -100
    return hidden, weight, b, labels.to(device)


def check_fused(backend, hidden, weight, bias, labels, *, temperature=1.0, entropy=False, tol=2e-5, grad_tol=None):
    out = fused_token_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                               return_entropy=entropy, backend=backend)
    outs = out if entropy else (out,)
    for o in outs:
        assert o.dtype == torch.float32 and o.shape == labels.shape
    ref = reference(hidden, weight, labels, bias, temperature)[: len(outs)]
    for o, r, name in zip(outs, ref, ("logp", "entropy")):
        assert_close(o.cpu(), r.cpu(), tol, name)
    params = [p for p in (hidden, weight, bias) if p is not None and p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    upstreams = [torch.randn(labels.shape, generator=gen, dtype=torch.float64).to(labels.device) for _ in outs]
    got = grads_of(outs, upstreams, params)
    want = grads_of(ref, upstreams, params)
    for g, w, p in zip(got, want, params):
        assert g.dtype == p.dtype and g.shape == p.shape
        assert_close(g.cpu(), w.cpu(), grad_tol or tol, f"grad {tuple(p.shape)}")


# ----------------------------------------------------------------------------------------------
# fused_token_logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable_head", "frozen_head"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp_entropy"])
def test_fused_matches_reference(backend, temperature, bias, trainable, entropy):
    hidden, weight, b, labels = make_case((7,), bias=bias, trainable=trainable, ignore=(2, 5),
                                          device=device_for(backend))
    check_fused(backend, hidden, weight, b, labels, temperature=temperature, entropy=entropy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_single_row(backend):
    hidden, weight, b, labels = make_case((1,), bias=True, device=device_for(backend))
    check_fused(backend, hidden, weight, b, labels, entropy=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_3d_inputs(backend):
    hidden, weight, b, labels = make_case((2, 5), ignore=(0, 9), device=device_for(backend))
    check_fused(backend, hidden, weight, b, labels, temperature=0.7, entropy=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_all_labels_ignored(backend):
    hidden, weight, b, labels = make_case((2, 3), bias=True, ignore=range(6), device=device_for(backend))
    logp, ent = fused_token_logprobs(hidden, weight, labels, bias=b, return_entropy=True, backend=backend)
    assert torch.equal(logp.cpu(), torch.zeros(2, 3)) and torch.equal(ent.cpu(), torch.zeros(2, 3))
    (logp.sum() + ent.sum()).backward()
    for p in (hidden, weight, b):
        assert p.grad is not None and not p.grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable_head", "frozen_head"])
def test_fused_bf16(backend, trainable):
    hidden, weight, b, labels = make_case((6,), dtype=torch.bfloat16, bias=True, trainable=trainable, ignore=(3,),
                                          device=device_for(backend))
    # the reference sees the same bf16-rounded inputs; bf16 logits round at ~0.4 %
    check_fused(backend, hidden, weight, b, labels, temperature=0.7, entropy=True, tol=3e-2, grad_tol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_tied_embedding(backend):
    device = device_for(backend)
    gen = torch.Generator().manual_seed(3)
    embedding = (torch.randn(V, H, generator=gen) * 0.5).to(device).requires_grad_()
    mix = torch.randn(H, H, generator=gen).to(device) / math.sqrt(H)
    tokens = torch.randint(0, V, (2, 4), generator=gen).to(device)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100

    def hidden_of(weight):
        return torch.tanh(weight[tokens] @ mix.to(weight.dtype))

    logp = fused_token_logprobs(hidden_of(embedding), embedding, labels, backend=backend)
    (got,) = torch.autograd.grad(logp.sum(), embedding)
    emb64 = embedding.detach().double().requires_grad_()
    ref, _ = reference(hidden_of(emb64), emb64, labels)
    (want,) = torch.autograd.grad(ref.sum(), emb64)
    assert_close(logp.cpu(), ref.cpu(), 2e-5, "logp")
    assert_close(got.cpu(), want.cpu(), 2e-5, "grad of the tied weight")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable_head", "frozen_head"])
def test_backward_passes_over_vocabulary_once_or_never(backend, trainable, monkeypatch):
    hidden, weight, b, labels = make_case((8,), trainable=trainable, ignore=(1, 4), device=device_for(backend))
    tiles = []

    def counting(original):
        def tile(h, w, *args):
            tiles.append((h.shape[0], w.shape[0]))
            return original(h, w, *args)
        return tile

    # every head-tile GEMM goes through one of these (torch path; Triton path's fp32 tiles)
    for name in ("_logits_tile", "_raw_logits_fp32"):
        monkeypatch.setattr(logprob, name, counting(getattr(logprob, name)))
    logp = fused_token_logprobs(hidden, weight, labels, backend=backend)
    # only the 6 kept rows reach the head, in tiles of at most TILE_ELEMENTS
    assert sum(rows for rows, _ in tiles) in (0, 6 * 4)  # 0: the fused Triton forward writes no tiles
    assert all(rows * cols <= logprob.TILE_ELEMENTS for rows, cols in tiles)
    tiles.clear()
    logp.sum().backward()
    if trainable:  # every (row chunk, vocab tile) pair recomputed exactly once: 2 chunks x 4 tiles
        assert sorted(tiles) == sorted([(3, 32), (3, 32), (3, 32), (3, 4)] * 2)
    else:  # frozen head: grad w.r.t. hidden from the expected head row summed in the forward
        assert tiles == []
    want = torch.autograd.grad(reference(hidden, weight, labels)[0].sum(), hidden)[0]
    assert_close(hidden.grad.cpu(), want.cpu(), 2e-5, "grad hidden")


def test_no_grad_mode_skips_the_expected_row(monkeypatch):
    # rollout / reference log-probs run under no_grad: the frozen-head extra GEMM must not run there
    hidden, weight, _, labels = make_case((5,), trainable=False)
    calls = []
    original = logprob._addmm_fp32
    monkeypatch.setattr(logprob, "_addmm_fp32", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        logp = fused_token_logprobs(hidden, weight, labels, backend="torch")
    assert calls == []
    assert_close(logp, reference(hidden, weight, labels)[0], 2e-5, "logp")
    fused_token_logprobs(hidden, weight, labels, backend="torch")
    assert calls  # with grad enabled it does


@pytest.mark.skipif(INTERPRET or logprob.triton is None, reason="the interpreter accepts CPU tensors")
def test_forced_gpu_backend_needs_cuda_or_interpreter():
    hidden, weight, _, labels = make_case((2,))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused_token_logprobs(hidden, weight, labels, backend="triton")


def test_fused_rejects_bad_input():
    hidden, weight, _, labels = make_case((4,))
    with pytest.raises(ValueError, match="labels"):
        fused_token_logprobs(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match="weight"):
        fused_token_logprobs(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="label 100 is outside"):
        fused_token_logprobs(hidden, weight, torch.tensor([0, 1, 100, -100]))
    with pytest.raises(ValueError, match="temperature"):
        fused_token_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        fused_token_logprobs(hidden, weight, labels, backend="cuda")
    with pytest.raises(ValueError, match="bias"):
        fused_token_logprobs(hidden, weight, labels, bias=torch.zeros(V + 1))


# ----------------------------------------------------------------------------------------------
# token_logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("shape", [(1,), (7,), (2, 4)], ids=["one_row", "rows", "3d"])
def test_token_logprobs_matches_reference(backend, temperature, shape):
    device = device_for(backend)
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(*shape, V, generator=gen) * 3).to(device).requires_grad_()
    labels = torch.randint(0, V, shape, generator=gen)
    if labels.numel() > 1:
        labels.view(-1)[1] = -100
    labels = labels.to(device)
    logp = token_logprobs(logits, labels, temperature=temperature, backend=backend)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ref = ref * (labels != -100)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    assert_close(logp.cpu(), ref.cpu(), 2e-6, "logp")
    upstream = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
    got = torch.autograd.grad((logp.double() * upstream).sum(), logits)[0]
    want = torch.autograd.grad((ref * upstream).sum(), logits)[0]
    assert_close(got.cpu(), want.cpu(), 2e-6, "grad logits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_bf16_and_all_ignored(backend):
    device = device_for(backend)
    logits = (torch.randn(3, V) * 3).to(device=device, dtype=torch.bfloat16).requires_grad_()
    labels = torch.tensor([5, -100, 99], device=device)
    logp = token_logprobs(logits, labels, temperature=1.3, backend=backend)
    ref = torch.log_softmax(logits.double() / 1.3, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    assert_close(logp.cpu(), (ref * (labels != -100)).cpu(), 1e-5, "logp")
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and not logits.grad[1].any()
    want = torch.autograd.grad((ref * (labels != -100)).sum(), logits)[0]
    assert_close(logits.grad.cpu(), want.cpu(), 1e-2, "grad logits")
    ignored = torch.full((3,), -100, device=device)
    out = token_logprobs(logits, ignored, backend=backend)
    assert torch.equal(out.cpu(), torch.zeros(3))


def test_token_logprobs_masked_vocabulary():
    # -inf logits (masked tokens) are legal; an entire -inf tile must not produce NaN
    logits = torch.randn(2, V)
    logits[:, :40] = -math.inf
    labels = torch.tensor([50, 99])
    logp = token_logprobs(logits, labels)
    ref = torch.log_softmax(logits.double(), -1)[torch.arange(2), labels]
    assert_close(logp, ref, 2e-6, "logp")


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


def reference_advantages(rewards, group_size, weights=None, scale="group", eps=1e-4):
    """float64, sample by sample: unscorable samples (every reward NaN) out of the statistics, advantage 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    rewards = rewards[:, None] if rewards.dim() == 1 else rewards
    weights = [1.0] * rewards.shape[1] if weights is None else list(weights)
    rows = rewards.tolist()
    totals = [None if all(math.isnan(r) for r in row) else sum(w * r for w, r in zip(weights, row) if not math.isnan(r))
              for row in rows]
    scored = torch.tensor([t for t in totals if t is not None], dtype=torch.float64)
    out = []
    for start in range(0, len(totals), group_size):
        group = totals[start : start + group_size]
        present = torch.tensor([t for t in group if t is not None], dtype=torch.float64)
        for t in group:
            if t is None or len(present) < 2:
                out.append(0.0)
            elif scale == "group":
                out.append((t - present.mean().item()) / (present.std().item() + eps))
            elif scale == "batch":
                out.append((t - present.mean().item()) / (scored.std().item() + eps))
            else:
                out.append(t - present.mean().item())
    return torch.tensor(out, dtype=torch.float64)


ADV_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_HERE, reason="Triton runs on CUDA, or in test_interpreter_suite's TRITON_INTERPRET=1 subprocess"))]


@pytest.mark.parametrize("backend", ADV_BACKENDS)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("group_size", [1, 3, 4])
def test_group_advantages_weighted_with_nan(backend, scale, group_size):
    gen = torch.Generator().manual_seed(5)
    rewards = torch.rand(12, 3, generator=gen) * 4
    rewards[1, 0] = rewards[6, 2] = math.nan
    rewards[7] = math.nan  # every reward missing: unscorable, out of its group's statistics, advantage 0
    rewards[9:11] = math.nan  # with groups of 3 (9, 10, 11) one scorable sample is left: no spread
    weights = [1.0, 0.5, 2.0]
    device = device_for(backend)
    adv = group_advantages(rewards.to(device), group_size, weights=weights, scale=scale, backend=backend)
    assert adv.dtype == torch.float32 and adv.shape == (12,)
    want = reference_advantages(rewards, group_size, weights, scale)
    assert_close(adv.cpu(), want, 1e-5, f"advantages scale={scale}")
    assert adv[7] == 0 and adv[9] == 0 and adv[10] == 0
    if group_size == 1:
        assert not adv.any()  # groups of one: std undefined, advantage defined as 0
    if group_size == 3:
        assert adv[11] == 0  # the group's only scorable sample has nothing to be compared with


@pytest.mark.parametrize("backend", ADV_BACKENDS)
def test_unscorable_samples_leave_the_baseline_as_in_trl(backend):
    """TRL 1.16 (sum_then_normalize): unscorable rows are NaN in the nan-aware mean / std, then advantage 0."""
    from trl.trainer import utils as trainer_utils  # requirements-dev.txt (CI installs it)
    rewards = torch.tensor([[1.0, 0.0], [math.nan, math.nan], [0.0, 2.0], [3.0, math.nan],
                            [math.nan, math.nan], [1.0, 1.0], [0.5, math.nan], [2.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards.to(device_for(backend)), 4, weights=weights, scale=scale,
                               backend=backend).cpu()
        unscorable = rewards.isnan().all(1)
        total = (rewards * weights).nansum(1)
        total[unscorable] = math.nan
        grouped = total.view(-1, 4)
        want = total - torch.nanmean(grouped, 1).repeat_interleave(4)
        if scale == "group":
            want = want / (trainer_utils.nanstd(grouped, dim=1).repeat_interleave(4) + 1e-4)
        elif scale == "batch":
            want = want / (trainer_utils.nanstd(total) + 1e-4)
        assert_close(adv, torch.nan_to_num(want, nan=0.0), 1e-6, f"TRL parity, scale={scale}")


@pytest.mark.parametrize("backend", ADV_BACKENDS)
def test_group_advantages_constant_groups_and_defaults(backend):
    device = device_for(backend)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], device=device)
    adv = group_advantages(rewards, 3, backend=backend)
    assert torch.equal(adv[:3].cpu(), torch.zeros(3))  # constant group: 0 / (0 + eps)
    assert_close(adv[3:].cpu(), torch.tensor([-1.0, 0.0, 1.0]) / (1 + 1e-4), 1e-6, "unbiased std, eps 1e-4")


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="weights"):
        group_advantages(torch.zeros(6, 2), 3, weights=[1.0])
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(6), 3, scale="global")
    with pytest.raises(ValueError, match=r"\[B\] or \[B, R\]"):
        group_advantages(torch.zeros(6, 2, 1), 3)


# ----------------------------------------------------------------------------------------------
# the Triton cases under the interpreter
# ----------------------------------------------------------------------------------------------


# The Triton cases under the interpreter, in two parts: the fast tier runs every kernel's cases (fused log-probs and
# entropy, token log-probs, group advantages, bf16 autocast); the full tier adds the sweep over every LM-head tile
# configuration and the TRL-parity case (it imports TRL, about a minute in a fresh interpreter).
SWEEP = "every_head_config or unscorable_samples_leave_the_baseline"


@pytest.mark.skipif(INTERPRET or HAS_CUDA or logprob.triton is None,
                    reason="the Triton cases run directly here (CUDA, or already interpreting)")
@pytest.mark.parametrize("cases", [f"triton and not ({SWEEP})",
                                   pytest.param(f"triton and ({SWEEP})", marks=[pytest.mark.slow, pytest.mark.full])],
                         ids=["kernels", "sweep"])
def test_interpreter_suite(cases):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    precision = os.path.join(os.path.dirname(__file__), "test_kernel_precision.py")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, precision, "-k", cases],
        capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
