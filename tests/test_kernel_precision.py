"""kernels/logprob.py precision and launch choices: autocast, the fp32-output GEMM and its fallback, and the
Triton launch configurations (each one run under the interpreter on tiny shapes).

The `triton` cases run in test_kernels.py's TRITON_INTERPRET=1 subprocess on a CPU-only machine, compiled on
CUDA.
"""

import pytest
import torch
from test_kernels import BACKENDS, INTERPRET, TRITON_HERE, assert_close, check_fused, device_for, reference
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.logprob as logprob
from kernels import fused_token_logprobs

GEMMS = {"mm", "addmm", "addmm_", "bmm", "matmul"}


class GemmLog(TorchDispatchMode):
    """Records the operand dtypes of every matrix product that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in GEMMS:
            operands = args[1:3] if name.startswith("addmm") else args[:2]
            self.calls.append((name, [a.dtype for a in operands], [tuple(a.shape) for a in operands]))
        return func(*args, **(kwargs or {}))


def head_case(n=7, vocab=100, hdim=24, *, device="cpu", dtype=torch.float32, trainable=True, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, hdim, generator=gen) * 0.5).to(device=device, dtype=dtype).requires_grad_(trainable)
    b = torch.randn(vocab, generator=gen).to(device=device, dtype=dtype).requires_grad_(trainable) if bias else None
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[2] = -100
    return hidden, weight, b, labels.to(device)


# ----------------------------------------------------------------------------------------------
# autocast
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable_head", "frozen_head"])
def test_autocast_bf16_over_fp32_weights(backend, trainable, monkeypatch):
    # what `accelerate --mixed_precision bf16` gives the kernel: fp32 weights and hidden states, bf16 autocast
    device = device_for(backend)
    monkeypatch.setattr(logprob, "VOCAB_TILE", 32)  # several tiles and row chunks
    monkeypatch.setattr(logprob, "TILE_ELEMENTS", 32 * 3)
    hidden, weight, b, labels = head_case(device=device, trainable=trainable)
    log = GemmLog()
    with torch.autocast(device, dtype=torch.bfloat16), log:
        logp, ent = fused_token_logprobs(hidden, weight, labels, bias=b, temperature=0.7, return_entropy=True,
                                         backend=backend)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    with torch.no_grad():
        plain = fused_token_logprobs(hidden, weight, labels, bias=b, temperature=0.7, backend=backend)
    assert (logp - plain).abs().max() > 1e-5  # the GEMMs did not run in fp32
    ref_logp, ref_ent = reference(hidden, weight, labels, b, 0.7)  # fp32 inputs: bf16 rounding is the error
    assert_close(logp.cpu(), ref_logp.cpu(), 3e-2, "logp")
    assert_close(ent.cpu(), ref_ent.cpu(), 3e-2, "entropy")
    with log:
        (logp.sum() + 0.5 * ent.sum()).backward()
    params = [p for p in (hidden, weight, b) if p.requires_grad]
    want = torch.autograd.grad(ref_logp.sum() + 0.5 * ref_ent.sum(), params)
    for p, w in zip(params, want):
        assert p.grad.dtype == torch.float32  # gradients in the parameters' dtype
        assert_close(p.grad.cpu(), w.cpu(), 3e-2, f"grad {tuple(p.shape)}")
    # every head GEMM ran in bf16 (the torch path has no fused kernel: all of them reach the dispatcher);
    # bmm is the entropy's row-wise dot over a tile, in fp32 on purpose
    head = [c for c in log.calls if c[0] != "bmm"]
    if backend == "torch":
        assert head, log.calls
        assert all(dtypes == [torch.bfloat16, torch.bfloat16] for _, dtypes, _ in head), log.calls


def test_no_autocast_keeps_fp32_gemms():
    hidden, weight, b, labels = head_case()
    log = GemmLog()
    with log:
        fused_token_logprobs(hidden, weight, labels, bias=b, backend="torch").sum().backward()
    assert log.calls and all(dtypes == [torch.float32, torch.float32] for _, dtypes, _ in log.calls), log.calls


def test_compute_dtype_follows_autocast_for_the_tensors_device():
    h, w = torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.bfloat16)
    assert logprob.compute_dtype(h, w) == torch.float32  # promoted
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert logprob.compute_dtype(h, w.float()) == torch.bfloat16
    if torch.cuda.is_available():  # CUDA autocast does not touch CPU tensors
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert logprob.compute_dtype(h, w.float()) == torch.float32


# ----------------------------------------------------------------------------------------------
# fp32-output GEMMs and their fallback
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_gemm_state(monkeypatch):
    monkeypatch.setattr(logprob, "_FP32_OUT_GEMM", {})
    monkeypatch.setattr(logprob, "_WARNED", set())


def test_missing_fp32_output_gemm_warns_once_on_cuda(fresh_gemm_state, recwarn):
    logprob._FP32_OUT_GEMM["cuda"] = (False, "NotImplementedError: no aten::mm.dtype")
    cuda = torch.device("cuda")
    assert logprob._low_precision_gemm_mode(cuda) == "fp32"
    assert logprob._low_precision_gemm_mode(cuda) == "fp32"
    warned = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1 and "fall back to fp32" in str(warned[0].message)
    assert "aten::mm.dtype" in str(warned[0].message)


def test_cpu_rounds_products_without_a_warning(fresh_gemm_state, recwarn):
    logprob._FP32_OUT_GEMM["cpu"] = (False, "NotImplementedError")
    assert logprob._low_precision_gemm_mode(torch.device("cpu")) == "round"
    logprob._FP32_OUT_GEMM["cpu"] = (True, "")
    assert logprob._low_precision_gemm_mode(torch.device("cpu")) == "fp32_out"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_probe_reports_why(fresh_gemm_state):
    ok, why = logprob._fp32_out_gemm(torch.device("cpu"))
    assert logprob._FP32_OUT_GEMM["cpu"] == (ok, why)
    assert ok or why  # a missing kernel comes with its reason, for the warning


@pytest.mark.parametrize("mode", ["round", "fp32"])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_addmm_fp32_modes_agree(monkeypatch, mode, beta):
    monkeypatch.setattr(logprob, "_low_precision_gemm_mode", lambda device: mode)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 16, generator=gen), torch.randn(16, 7, generator=gen).bfloat16()
    acc = torch.full((5, 7), float("nan")) if beta == 0 else torch.randn(5, 7, generator=gen)
    want = (beta * acc.double() if beta else 0) - 0.5 * a.bfloat16().double() @ b.double()
    logprob._addmm_fp32(acc, a, b, alpha=-0.5, beta=beta)
    assert acc.dtype == torch.float32 and not acc.isnan().any()  # beta = 0 ignores the (NaN) content
    assert_close(acc, want, 1e-2 if mode == "round" else 1e-6, f"{mode} beta={beta}")


def test_cpu_low_precision_tiles_reuse_their_buffers(monkeypatch):
    # On the CPU a fresh tile-sized tensor costs page faults on every tile: under autocast the torch path casts
    # the weight tile, the gradient tile (once, for both gradient GEMMs) and the rounded products into reused
    # buffers. Outputs and gradients are those of plain .to() casts (tests above and test_kernels.py).
    monkeypatch.setattr(logprob, "VOCAB_TILE", 32)  # 4 tiles, the last one narrower; 6 kept rows in 2 chunks
    monkeypatch.setattr(logprob, "TILE_ELEMENTS", 32 * 3)
    calls = []
    original = logprob._addmm_fp32

    def spy(acc, a, b, *args, **kwargs):
        calls.append((a.dtype, a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr(), kwargs.get("scratch")))
        return original(acc, a, b, *args, **kwargs)

    monkeypatch.setattr(logprob, "_addmm_fp32", spy)
    hidden, weight, b, labels = head_case(n=7, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = fused_token_logprobs(hidden, weight, labels, backend="torch")
    (logp * torch.linspace(-1, 1, 7)).sum().backward()
    assert len(calls) == 2 * 4 * 2  # grad hidden and grad weight, each (vocab tile, row chunk)
    assert {dtype for dtype, *_ in calls} == {torch.bfloat16}  # the gradient tile arrives cast, once
    assert len({a for _, a, _, _ in calls}) == 1  # ... into one buffer for every tile
    assert len({b for _, _, b, _ in calls[0::2]}) == 1  # every weight tile in one buffer (grad hidden's operand)
    assert all(scratch is not None for *_, scratch in calls)  # rounded products into a buffer too
    assert_close(hidden.grad, torch.autograd.grad(
        (reference(hidden, weight, labels)[0] * torch.linspace(-1, 1, 7)).sum(), hidden)[0], 3e-2, "grad hidden")


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_addmm_fp32_round_into_scratch(monkeypatch, beta):
    monkeypatch.setattr(logprob, "_low_precision_gemm_mode", lambda device: "round")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 16, generator=gen), torch.randn(16, 7, generator=gen).bfloat16()
    acc = torch.randn(5, 7, generator=gen)
    fresh, reused = acc.clone(), acc.clone()
    logprob._addmm_fp32(fresh, a, b, alpha=-0.5, beta=beta)
    scratch = logprob.Scratch(torch.device("cpu"))
    logprob._addmm_fp32(reused, a, b, alpha=-0.5, beta=beta, scratch=scratch)
    assert torch.equal(fresh, reused) and tuple(scratch.buffers["product"].shape) == (5 * 7,)


# ----------------------------------------------------------------------------------------------
# Triton launch configurations
# ----------------------------------------------------------------------------------------------

KIB = 1024
CARDS = {"A10/L4/L40S/RTX 4090": 99 * KIB, "V100": 96 * KIB, "A100": 163 * KIB, "H100/H200": 227 * KIB}


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("cdtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32)], ids=["bf16", "autocast", "fp32"])
def test_head_configs_fit_the_card(card, cdtype, w_dtype):
    limit = CARDS[card]
    configs = logprob.head_configs(cdtype, w_dtype, limit)
    h_bytes, w_bytes = (2 if cdtype == torch.bfloat16 else 4), (2 if w_dtype == torch.bfloat16 else 4)
    assert configs
    for config in configs:
        assert logprob.head_smem_bytes(config, h_bytes, w_bytes) + logprob.SMEM_RESERVE <= limit, config
    candidates = logprob.HEAD_CONFIGS_LOW_PRECISION if cdtype == torch.bfloat16 else logprob.HEAD_CONFIGS_FP32
    assert configs == [c for c in candidates if c in configs]  # preference order kept


def test_head_configs_pick_the_big_tile_only_where_it_fits():
    big = (128, 128, 64, 8, 3)  # 96 KiB of bf16 operand tiles
    assert logprob.head_smem_bytes(big, 2, 2) == 96 * KIB
    assert logprob.head_configs(torch.bfloat16, torch.bfloat16, 227 * KIB)[0] == big
    assert logprob.head_configs(torch.bfloat16, torch.bfloat16, 163 * KIB)[0] == big
    assert big not in logprob.head_configs(torch.bfloat16, torch.bfloat16, 99 * KIB)
    # a card smaller than every candidate still gets the smallest one (Triton then says what is missing)
    tiny = logprob.head_configs(torch.bfloat16, torch.bfloat16, 16 * KIB)
    assert tiny == [min(logprob.HEAD_CONFIGS_LOW_PRECISION, key=lambda c: logprob.head_smem_bytes(c, 2, 2))]


@pytest.mark.skipif(logprob.triton is None, reason="needs triton's OutOfResources")
def test_config_rejected_by_the_gpu_is_dropped_once(monkeypatch, recwarn):
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(logprob, "_HEAD_CONFIG_CACHE", {})
    monkeypatch.setattr(logprob, "_WARNED", set())
    configs = logprob.HEAD_CONFIGS_LOW_PRECISION[:3]
    tried = []

    def launch(config):
        tried.append(config)
        if config == configs[0]:
            raise OutOfResources(110 * KIB, 99 * KIB, "shared memory")
        return config

    assert logprob._with_fitting_config("key", lambda: configs, launch) == configs[1]
    assert logprob._with_fitting_config("key", lambda: configs, launch) == configs[1]
    assert tried == [configs[0], configs[1], configs[1]]  # the rejected one is not tried again
    assert len([w for w in recwarn if "does not fit" in str(w.message)]) == 1

    def never(config):
        raise OutOfResources(1, 0, "shared memory")

    with pytest.raises(OutOfResources):  # nothing fits: Triton's own error reaches the user
        logprob._with_fitting_config("other", lambda: configs[:1], never)


ALL_CONFIGS = [pytest.param(c, dtype, id=f"{name}-" + "x".join(map(str, c)))
               for name, dtype, configs in (("bf16", torch.bfloat16, logprob.HEAD_CONFIGS_LOW_PRECISION),
                                            ("fp32", torch.float32, logprob.HEAD_CONFIGS_FP32))
               for c in configs]


@pytest.mark.skipif(not TRITON_HERE, reason="Triton runs on CUDA, or in test_kernels.py's TRITON_INTERPRET=1 "
                                            "subprocess")
@pytest.mark.parametrize("config,dtype", ALL_CONFIGS)
def test_every_head_config_triton(config, dtype, monkeypatch):
    # vocabulary and hidden size not multiples of any block: ragged tiles in both loops, several splits
    hidden, weight, b, labels = head_case(n=9, vocab=300, hdim=70, device=device_for("triton"), dtype=dtype)
    if INTERPRET:
        monkeypatch.setattr(logprob, "INTERPRETER_HEAD_CONFIG", config)
    else:  # compiled: run exactly this configuration
        monkeypatch.setattr(logprob, "_with_fitting_config", lambda key, candidates, launch: launch(config))
    tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
    check_fused("triton", hidden, weight, b, labels, temperature=0.7, entropy=True, tol=tol, grad_tol=tol)
