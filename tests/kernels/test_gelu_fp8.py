"""The feed-forward pass (tanh-GELU + per-row FP8 scaling in one kernel) against a float64 reference.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py) at small widths; the GPU test
runs it at the hidden widths of Wan2.1-1.3B and 14B. Outputs are allocated poisoned (0xFF bytes:
NaN in e4m3 and float32), so that an element the kernel leaves unwritten shows.
"""

import math

import pytest
import torch

from fsattn_diffusers.kernels.gelu_fp8 import MAX_COLS, MIN_PART, gelu_tanh_fp8_rows, row_parts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture
def poisoned(monkeypatch):
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def reference(x: torch.Tensor):
    """In float64: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) rounded to bf16 (as the model's GELU
    returns it), the row's max |y| / 448 in float32, then y / scale in e4m3."""
    x64 = x.double()
    y = (0.5 * x64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))).to(torch.bfloat16)
    amax = y.float().abs().amax(dim=-1, keepdim=True)
    scale = amax / 448.0
    q = torch.where(amax > 0, y.double() / scale.double(), 0.0).clamp(-448, 448).to(FP8)
    return q, scale


def assert_matches(x, q, scale):
    ref_q, ref_scale = reference(x.cpu())
    q, scale = q.cpu().float(), scale.cpu()
    assert q.shape == x.shape and scale.shape == (x.shape[0], 1)
    assert torch.isfinite(q).all() and torch.isfinite(scale).all()
    torch.testing.assert_close(scale, ref_scale, rtol=2e-7, atol=0)
    # Ties between two e4m3 (or bf16) values may round either way after float32 arithmetic: a
    # handful of one-step differences, never more than one step.
    ref = ref_q.float()
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -6))) - 3)
    assert ((q - ref).abs() <= step).all()
    assert (q == ref).float().mean() >= 0.999


@pytest.mark.parametrize("n_cols", [1, 100, 512, 600, 1700, 2304, 7169, 28673, MAX_COLS])
def test_row_parts_cover_the_row_in_powers_of_two(n_cols):
    parts = row_parts(n_cols)
    used = [p for p in parts if p]
    assert len(parts) == 3 and parts[: len(used)] == tuple(used)  # unused parts (0) come last
    assert all(p & (p - 1) == 0 and p >= MIN_PART for p in used)
    assert 0 <= sum(parts) - n_cols < used[-1]  # only the last part has idle lanes


def test_row_parts_of_the_model_widths():
    assert row_parts(8960) == (8192, 512, 512)  # Wan2.1-1.3B: 8,960 = 8,192 + 512 + 256 used of the last
    assert row_parts(13824) == (8192, 4096, 2048)  # Wan2.1-14B: 1,536 of the last 2,048 used


@pytest.mark.parametrize("n_cols", [0, MAX_COLS + 1])
def test_row_parts_refuse_widths_it_cannot_hold(n_cols):
    with pytest.raises(ValueError, match=rf"rows of 1 to {MAX_COLS} columns, got {n_cols}"):
        row_parts(n_cols)


@pytest.mark.parametrize("rows, n_cols", [(3, 100), (2, 600), (2, 1700)])
def test_matches_float64(poisoned, rows, n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    x = torch.randn(rows, n_cols, generator=gen) * 3
    x[0, :6] = torch.tensor([-30.0, 30.0, 0.0, -0.5, 8.0, -3.0])  # saturated tails, zero, both signs
    x = x.to(torch.bfloat16).to(DEVICE)
    assert_matches(x, *gelu_tanh_fp8_rows(x))


def test_a_nan_makes_its_row_scale_nan_and_leaves_the_others(poisoned):
    x = (torch.randn(3, 1700, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
    x[0, 3] = float("nan")  # in the first part
    x[2, 1699] = float("nan")  # in the last
    q, scale = gelu_tanh_fp8_rows(x.to(DEVICE))
    assert scale[0].isnan().item() and scale[2].isnan().item()
    assert_matches(x[1:2], q[1:2], scale[1:2])


def test_a_zero_row_gets_scale_zero_and_zeros_and_strided_rows_are_read_as_rows(poisoned):
    gen = torch.Generator().manual_seed(1)
    wide = (torch.randn(3, 700, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    wide[1] = 0
    x = wide[:, 50:650]  # row stride 700, 600 columns
    q, scale = gelu_tanh_fp8_rows(x)
    assert scale[1].item() == 0 and (q[1].float() == 0).all()
    assert_matches(x, q, scale)


@pytest.mark.parametrize("x, message", [
    (torch.zeros(4, 64), "2-D bfloat16 tensor with unit column stride, got shape \\(4, 64\\), torch.float32"),
    (torch.zeros(2, 4, 64, dtype=torch.bfloat16), "got shape \\(2, 4, 64\\)"),
    (torch.zeros(64, 4, dtype=torch.bfloat16).t(), "strides \\(1, 4\\)"),
])
def test_bad_input_is_refused_by_name(x, message):
    with pytest.raises(ValueError, match=message):
        gelu_tanh_fp8_rows(x.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [8960, 12288, 13824])
def test_matches_float64_at_the_model_widths(poisoned, n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    x = (torch.randn(2048, n_cols, generator=gen) * 2).to(torch.bfloat16)
    x[0, :3] = torch.tensor([-30.0, 30.0, 0.0])
    x[7] = 0
    q, scale = gelu_tanh_fp8_rows(x.cuda())
    assert scale[7].item() == 0
    assert_matches(x, q, scale)
