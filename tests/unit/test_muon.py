"""raychat.train.muon against torch.optim.Muon (torch 2.13) and against the algebra of Newton-Schulz:
same update as torch's (bit for bit in bf16, and in fp32 with torch's bf16 cast neutralized), the singular
values that the quintic predicts, the sharded update on 2 gloo ranks equal to the unsharded one."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raychat.ports import free_ports
from raychat.train.muon import (
    NS_COEFFICIENTS,
    Muon,
    assign_owners,
    choose_ns_dtype,
    ns_flops,
    zeropower_via_newtonschulz,
)

# wide, tall and square matrices (the tall ones take the transposed path)
SHAPES = [(48, 80), (80, 48), (64, 64), (32, 96), (96, 40), (24, 24), (40, 56)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(opt: torch.optim.Optimizer, params: list, steps: range) -> list[torch.Tensor]:
    for step in steps:
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def _saved(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() through torch.save/torch.load, as a checkpoint stores it (no shared tensors)."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _quintic(s: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(40, 96), (96, 40)])
def test_newton_schulz_maps_singular_values_by_the_quintic(shape):
    """X_{k+1} = a X + b (X X^T) X + c (X X^T)^2 X = U p(S) V^T: the output is U p^5(S / ||G||_F) V^T."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    scaled = s / g.norm()
    assert scaled.min() > 0.005  # inside the band below (a random rectangular matrix is well conditioned)
    expected = u @ torch.diag(_quintic(scaled, 5)) @ vh

    out = zeropower_via_newtonschulz(g.float(), dtype=torch.float32)
    assert out.shape == shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    # the known band of the 5-step quintic for inputs in [0.005, 1]: [0.68, 1.16], not exactly 1
    sv = torch.linalg.svdvals(out.double())
    assert sv.min() > 0.68 and sv.max() < 1.16
    assert sv.max() - sv.min() > 0.05  # and not an exact orthogonalization (that would be a different map)

    bf16 = zeropower_via_newtonschulz(g.float(), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), expected, atol=3e-2, rtol=0)


def test_newton_schulz_leaves_its_input_alone_and_checks_arguments():
    g = torch.randn(16, 8)
    before = g.clone()
    zeropower_via_newtonschulz(g)
    assert torch.equal(g, before)
    with pytest.raises(ValueError, match="2-D"):
        zeropower_via_newtonschulz(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="ns_steps"):
        zeropower_via_newtonschulz(g, steps=100)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"nesterov": False, "weight_decay": 0.0},
        {"lr": 0.05, "momentum": 0.9, "adjust_lr_fn": "match_rms_adamw"},
    ],
)
def test_bf16_is_torch_muon_bit_for_bit(kwargs):
    ours, ref = _params(), _params()
    a = _run(Muon(ours, ns_dtype=torch.bfloat16, **kwargs), ours, range(4))
    b = _run(torch.optim.Muon(ref, **kwargs), ref, range(4))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kwargs", [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw", "lr": 0.02}])
def test_fp32_is_torch_muon_with_its_bf16_cast_removed(monkeypatch, kwargs):
    """torch's Newton-Schulz runs `grad.bfloat16()` first; with that one call made a copy instead, torch's
    own code computes the fp32 algorithm, and ours gives the same update bit for bit (the same operations in
    the same order)."""
    ours, ref = _params(), _params()
    a = _run(Muon(ours, ns_dtype=torch.float32, **kwargs), ours, range(4))
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self, *args, **kw: self.clone())
    b = _run(torch.optim.Muon(ref, **kwargs), ref, range(4))
    monkeypatch.undo()
    start = _params()
    for x, y, x0 in zip(a, b, start):
        assert y.dtype == torch.float32 and not torch.equal(y, x0)
        assert torch.equal(x, y)


def test_fp32_and_bf16_updates_agree_to_bf16_precision():
    ours, ref = _params(), _params()
    a = _run(Muon(ours, lr=0.02, ns_dtype=torch.float32), ours, range(3))
    b = _run(Muon(ref, lr=0.02, ns_dtype=torch.bfloat16), ref, range(3))
    start = _params()
    for x, y, x0 in zip(a, b, start):
        step, other = x - x0, y - x0
        assert ((step - other).norm() / step.norm()).item() < 0.02


def test_state_dict_is_interchangeable_with_torch_muon():
    """Checkpoints written with torch.optim.Muon (before this module) resume into ours, and back."""
    ref = _params()
    torch_opt = torch.optim.Muon(ref, lr=0.02)
    _run(torch_opt, ref, range(2))
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    ours_opt = Muon(ours, lr=0.5, ns_dtype=torch.bfloat16)
    ours_opt.load_state_dict(_saved(torch_opt))
    assert ours_opt.param_groups[0]["lr"] == 0.02
    for x, y in zip(_run(ours_opt, ours, range(2, 4)), _run(torch_opt, ref, range(2, 4))):
        assert torch.equal(x, y)
    back = torch.optim.Muon(_params(), lr=0.5)
    back.load_state_dict(_saved(ours_opt))
    assert torch.equal(
        back.state_dict()["state"][0]["momentum_buffer"], ours_opt.state[ours[0]]["momentum_buffer"]
    )


def test_muon_rejects_bad_settings():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.ones(4))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon(_params(), adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon(_params(), ns_dtype=torch.float16)
    with pytest.raises(ValueError, match="lr"):
        Muon(_params(), lr=-1.0)


def test_ns_flops_and_owner_assignment_by_hand():
    # (256, 704): s = 256, w = 704: 5 * (4 * 256^2 * 704 + 2 * 256^3)
    assert ns_flops((256, 704)) == ns_flops((704, 256)) == 5 * (184_549_376 + 33_554_432) == 1_090_519_040
    assert ns_flops((256, 256)) == 5 * 6 * 256**3
    # 3 big (cost B) then 4 small (0.4615 B each), longest first to the least-loaded rank:
    # r0 B, r1 B, r0 2B; small -> r1 1.46B -> r1 1.92B -> r1 2.38B; the last small -> r0 2.46B
    shapes = [(256, 704), (704, 256), (256, 704)] + [(256, 256)] * 4
    assert assign_owners(shapes, 2) == [0, 1, 0, 1, 1, 1, 0]
    assert assign_owners(shapes, 1) == [0] * 7
    assert sorted(assign_owners([(8, 8), (4, 4)], 3)) == [0, 1]  # a third rank gets nothing


def test_dtype_choice_follows_the_device_capability(monkeypatch):
    with pytest.raises(ValueError, match="ns_dtype must be one of"):
        choose_ns_dtype("fp16")
    assert choose_ns_dtype("float32").dtype == torch.float32
    assert choose_ns_dtype("bfloat16", "cpu").describe() == "Newton-Schulz in bfloat16 on cpu (requested)"
    here = choose_ns_dtype("auto", "cpu")
    assert here.dtype == (torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32)
    assert choose_ns_dtype("auto", "cpu") == here  # a rule: the same answer every time
    # both branches of each rule, whatever this machine is
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    no_bf16 = choose_ns_dtype("auto", "cpu")
    assert no_bf16.dtype == torch.float32 and "no AVX512-BF16" in no_bf16.describe()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert choose_ns_dtype("auto", "cpu").dtype == torch.bfloat16
    for capability, dtype in (((7, 5), torch.float32), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        choice = choose_ns_dtype("auto", "cuda:0")
        assert choice.dtype == dtype and choice.device == "cuda:0"
        assert f"compute capability {capability[0]}.{capability[1]}" in choice.describe()
    assert choose_ns_dtype("auto", "meta").dtype == torch.float32


class _CountingMuon(Muon):
    """Counts the matrices this rank orthogonalizes (to show the work is split)."""

    calls = 0

    def _orthogonalize(self, group, u):
        self.calls += 1
        return super()._orthogonalize(group, u)


DTYPE_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]  # (rank 0's, rank 1's)


def _sharded_rank(rank, world, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for case, dtypes in enumerate(DTYPE_CASES):
            sharded_params, plain_params = _params(), _params()
            sharded = _CountingMuon(sharded_params, lr=0.02, ns_dtype=dtypes[rank])
            plain = Muon(plain_params, lr=0.02, ns_dtype=dtypes[0], shard=False)
            out[case, rank] = {
                "sharded": _run(sharded, sharded_params, range(3)),
                "plain": _run(plain, plain_params, range(3)),
                "buffers": [sharded.state[p]["momentum_buffer"].clone() for p in sharded_params],
                "calls": sharded.calls,
                "dtype": sharded.ns_dtype,
            }
    finally:
        dist.destroy_process_group()


def test_sharded_update_equals_unsharded_on_two_gloo_ranks():
    """Same gradients on both ranks (as after DDP's all-reduce): each rank orthogonalizes its share, the
    all_gather hands out the rest; params and momentum end identical on both ranks and equal to an
    unsharded Muon. With a different ns_dtype per rank, rank 0's wins on both."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_sharded_rank, args=(2, free_ports(1)[0], out), nprocs=2, join=True)
        results = dict(out)
    owners = assign_owners(SHAPES, 2)
    assert 0 < owners.count(0) < len(SHAPES)
    for case, dtypes in enumerate(DTYPE_CASES):
        r = {rank: results[case, rank] for rank in (0, 1)}
        for rank in (0, 1):
            assert r[rank]["dtype"] == dtypes[0]
            assert r[rank]["calls"] == 3 * owners.count(rank)
            for x, y in zip(r[rank]["sharded"], r[rank]["plain"]):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
        for x, y in zip(r[0]["sharded"] + r[0]["buffers"], r[1]["sharded"] + r[1]["buffers"]):
            assert torch.equal(x, y)
