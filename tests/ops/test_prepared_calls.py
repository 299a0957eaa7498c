"""The op's prepared calls: a call of a kind seen before only allocates its buffers and launches.

On the CPU the GPU's path (``ops._on_gpu``) runs on CPU tensors, with the real kernels in
Triton's interpreter at its small tiles and buffers of their own; the one-allocation layout the
GPU uses is checked against the tensors' layout and, with stand-in launch objects, region by
region. The GPU tests compare prepared calls with first calls byte for byte.
"""

import pytest
import torch

from fsattn_diffusers import FSAttnConfig, ops
from fsattn_diffusers.attention import key_mask
from fsattn_diffusers.plan import INTERPRETER
from interpreter_only import skip_without_interpreter

CONFIG = FSAttnConfig().to_json()


@pytest.fixture(autouse=True)
def fresh_calls(monkeypatch, request):
    """No call prepared yet; on the CPU, the interpreter's tiles. Most tests not marked gpu run the
    kernels on CPU tensors, in the interpreter: where it is off (a GPU machine) all of those skip,
    the few that launch nothing with them."""
    monkeypatch.setattr(ops, "_prepared_calls", {})
    if request.node.get_closest_marker("gpu") is None:
        skip_without_interpreter()
        monkeypatch.setattr(ops, "target_of", lambda device: INTERPRETER)


def _operands(seed, layout="NHD", mask=None, shape=(1, 40, 2, 32), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(3))
    attn_mask = None
    if mask is not None:
        keep = torch.rand(shape[0], 1, 1, shape[1], generator=gen) > 0.3
        attn_mask = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    weight, bias = key_mask(attn_mask, q, k)
    if layout == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return q, k, v, weight, bias


def _call(operands, layout="NHD", config=CONFIG):
    return ops._on_gpu(*operands, 0.2, layout, config, -1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_a_second_call_of_a_kind_reuses_its_preparation_and_gives_what_a_first_call_gives(layout, mask):
    first = _call(_operands(1, layout, mask), layout)
    (prepared,) = ops._prepared_calls.values()
    second_operands = _operands(2, layout, mask)
    second = _call(second_operands, layout)
    assert list(ops._prepared_calls.values()) == [prepared]
    ops._prepared_calls.clear()
    unprepared = _call(second_operands, layout)  # the first-call path on the same operands
    assert ops._prepared_calls and list(ops._prepared_calls.values()) != [prepared]
    assert torch.equal(second[0], unprepared[0]) and torch.equal(second[1], unprepared[1])
    assert not torch.equal(first[0], second[0])  # not the first call's buffers handed back
    assert second[0].shape == second_operands[0].shape and second[0].is_contiguous()


def test_a_boolean_mask_reaches_the_op_as_a_view_of_itself():
    # A cast to float would cost a launch and a copy on every masked call.
    q = torch.randn(2, 40, 2, 32)
    keep = torch.rand(1, 1, 1, 40) > 0.3
    weight, bias = key_mask(keep, q, q)
    assert bias is None and weight.dtype == torch.bool and weight.shape == (2, 40)
    assert weight.data_ptr() == keep.data_ptr() and weight.stride(0) == 0
    float_weight, _ = key_mask(torch.zeros(keep.shape).masked_fill(~keep, float("-inf")), q, q)
    assert torch.equal(weight.float(), float_weight)
    # A boolean and a float weight of one shape and strides specialise the pre-pass differently:
    # two kinds of call.
    same_strides = keep.reshape(1, 40).float().expand(2, 40)
    assert same_strides.stride() == weight.stride()
    assert ops._call_key(q, q, q, weight, None, "NHD", CONFIG) != ops._call_key(q, q, q, same_strides, None, "NHD",
                                                                               CONFIG)


def test_every_property_a_preparation_depends_on_is_in_its_key():
    base = _operands(1)
    q, k, v, w, b = base
    variants = {
        "another length": _operands(1, shape=(1, 48, 2, 32)),
        "another dtype": _operands(1, dtype=torch.float16),
        "other strides": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, w, b),
        "unaligned": (torch.cat([q.flatten(), q.flatten()[:1]])[1:].view(q.shape), k, v, w, b),
        "a key-padding mask": _operands(1, mask="bool"),
        "a float mask": _operands(1, mask="float"),
    }
    keys = [ops._call_key(*base[:5], "NHD", CONFIG), ops._call_key(*base[:5], "HND", CONFIG),
            ops._call_key(*base[:5], "NHD", FSAttnConfig(block_n=64).to_json())]
    keys += [ops._call_key(*operands, "NHD", CONFIG) for operands in variants.values()]
    assert len(set(keys)) == len(keys)
    # Other values of the same kind: the same key.
    assert ops._call_key(*_operands(7), "NHD", CONFIG) == keys[0]


def test_a_forward_is_prepared_per_kind_of_quantised_v():
    # The prepared launch skips Triton's specialisation: V in 16 bits and in FP8 must not share one.
    from fsattn_diffusers.kernels.fsattn_fwd import prepare_fsattn_fwd
    from fsattn_diffusers.kernels.quantize import quantize_kv

    q, k, v, _, _ = _operands(1)
    out, lse, counter = torch.empty_like(q), torch.empty(1, 2, 40), torch.zeros(1, dtype=torch.int32)
    forwards = [prepare_fsattn_fwd(q, quantize_kv(k, v, block_n=16, d_pad=32, v_dtype=dtype), out, lse, counter,
                                   block_m=16) for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float8_e4m3fn)]
    assert forwards[0] is forwards[2] and forwards[0] is not forwards[1]


def test_a_forward_is_prepared_per_alignment_of_every_tensor_it_is_handed():
    # A caller's LSE buffer 4 bytes off 16-byte alignment must not reuse a build that assumed it.
    from fsattn_diffusers.kernels.fsattn_fwd import prepare_fsattn_fwd
    from fsattn_diffusers.kernels.quantize import quantize_kv

    q, k, v, _, _ = _operands(1)
    kv = quantize_kv(k, v, block_n=16, d_pad=32)
    out, counter = torch.empty_like(q), torch.zeros(1, dtype=torch.int32)
    lse = torch.empty(q.shape[0] * q.shape[2] * q.shape[1] + 4)
    aligned, unaligned = (lse[i:i + lse.numel() - 4].view(q.shape[0], q.shape[2], q.shape[1]) for i in (0, 1))
    prepared = [prepare_fsattn_fwd(q, kv, out, t, counter, block_m=16) for t in (aligned, unaligned, aligned)]
    assert prepared[0] is prepared[2] and prepared[0] is not prepared[1]


class _Recorder:
    """A stand-in K/V pre-pass or forward: records what it is launched with."""

    def __init__(self, direct, **fields):
        self.direct, self.calls = direct, []
        vars(self).update(fields)

    def __getattr__(self, name):  # launch, run, run_into
        return lambda *args: self.calls.append((name, args))


@pytest.mark.parametrize("direct", [True, False])
def test_a_prepared_call_hands_each_launch_its_region_of_one_allocation(direct):
    # On a GPU (a stream given) and once every launch goes straight to its kernel, the buffers are
    # carved from one allocation: each launch must get its own region, the statistics their
    # offsets in the workspace. Before that (the interpreter, a launch Triton did not remember)
    # they stay tensors, allocated by the launch objects.
    from fsattn_diffusers.kernels.launch import carved_bytes

    prepass = _Recorder(direct, buffer_bytes=(1000, 300, 600, 32), stat_offsets=(0, 8, 16, 200), s_pad=48)
    forward = _Recorder(direct, q_buffer_bytes=(700, 40, 40))
    call = ops.PreparedCall(prepass, forward, False, "NHD", (1, 2, 40), 4)
    q, k, v, _, _ = _operands(1)
    out, lse = call.run(q, k, v, None, None, 0.2, stream=7)
    assert out.shape == q.shape and lse.shape == (1, 2, 40)
    if not direct:
        assert [c[0] for c in prepass.calls + forward.calls] == ["run", "run"]
        return
    ((_, (_, _, _, ws, k_q, v_t, rowsum, stream)),) = prepass.calls
    ((_, (_, buffers, _, _, scale, forward_stream)),) = forward.calls
    assert (stream, forward_stream, scale) == (7, 7, 0.2)
    assert (buffers.workspace, buffers.k_q, buffers.v_t, buffers.rowsum_weights) == (ws, k_q, v_t, rowsum)
    assert [buffers.k_mean - ws, buffers.v_mean - ws, buffers.v_scale - ws, buffers.k_scale - ws] == [0, 8, 16, 200]
    regions = [ws, k_q, v_t, rowsum, buffers.q_q, buffers.q_scale, buffers.q_dot_k_mean]
    sizes = (1000, 300, 600, 32, 700, 40, 40)
    ends = [a + n for a, n in zip(regions, sizes)]
    assert all(end <= start for end, start in zip(ends, regions[1:]))  # in order, none overlapping
    assert ends[-1] - ws <= carved_bytes(sizes) and all(a % 256 == ws % 256 for a in regions)


def test_each_kind_of_call_is_prepared_once():
    for seed in range(3):
        _call(_operands(seed))
        _call(_operands(seed, shape=(1, 24, 2, 32)))
    assert len(ops._prepared_calls) == 2


def _gpu_operands(seed, head_dim, seq_k, mask):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 700, 4, head_dim, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(1, seq_k, 4, head_dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    attn_mask = None
    if mask is not None:
        keep = torch.rand(1, 1, 1, seq_k, device="cuda", generator=gen) > 0.3
        attn_mask = keep if mask == "bool" else torch.zeros(keep.shape, device="cuda").masked_fill(~keep, -1e4)
    return q, k, v, attn_mask


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, seq_k", [(128, 3000), (128, 300), (64, 3000)])  # warp-specialised, Triton
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_gpu_a_prepared_call_gives_the_bytes_of_a_first_call(head_dim, seq_k, mask):
    from fsattn_diffusers import fsattn

    q, k, v, attn_mask = _gpu_operands(1, head_dim, seq_k, mask)
    fsattn(q, k, v, attn_mask=attn_mask)
    assert len(ops._prepared_calls) == 1
    q, k, v, attn_mask = _gpu_operands(2, head_dim, seq_k, mask)
    prepared = fsattn(q, k, v, attn_mask=attn_mask, return_lse=True)
    ops._prepared_calls.clear()
    first = fsattn(q, k, v, attn_mask=attn_mask, return_lse=True)
    assert torch.equal(prepared[0], first[0]) and torch.equal(prepared[1], first[1])


@pytest.mark.gpu
def test_gpu_a_prepared_call_launches_on_the_current_stream():
    # Operands written on a busy side stream: launches on any other stream would read them unwritten.
    from fsattn_diffusers import fsattn

    q, k, v, _ = _gpu_operands(3, 128, 3000, None)
    expected = fsattn(q, k, v)  # prepares the call
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of a spinning kernel
        q2, k2, v2 = (t.clone() for t in (q, k, v))
        got = fsattn(q2, k2, v2)
    side.synchronize()
    assert torch.equal(got, expected)


@pytest.mark.parametrize("k_per_token, v_dtype, masked", [(True, torch.float8_e4m3fn, False),
                                                          (False, torch.bfloat16, True)])
def test_the_one_allocation_layout_is_the_layout_of_the_tensors(k_per_token, v_dtype, masked):
    # On a GPU a prepared call carves every pre-pass buffer from one allocation and passes
    # addresses: each region must be as large as the tensor it stands for, and the statistics'
    # offsets those of the workspace's views.
    from fsattn_diffusers.kernels.quantize import QPrepass, kv_prepass

    q, k, v, _, _ = _operands(1, shape=(2, 40, 2, 32))
    weight = (torch.rand(2, 40) > 0.3).float() if masked else None
    prepass = kv_prepass(k, v, weight, block_n=16, d_pad=32, k_per_token=k_per_token, smooth_v=True,
                         v_dtype=v_dtype, pv_key_order="natural")
    kv = prepass.run(k, v, weight)
    tensors = (kv.workspace, kv.k_q, kv.v_t, kv.rowsum_weights)
    assert prepass.buffer_bytes == tuple(t.numel() * t.element_size() for t in tensors)
    views = (kv.k_mean, kv.v_mean, kv.v_scale, kv.k_scale)
    assert prepass.stat_offsets == tuple(t.data_ptr() - kv.workspace.data_ptr() for t in views)
    q_prepass = QPrepass(tuple(q.shape), q.stride(), 2, 32, kv.n_split, 16, 32)
    qq = q_prepass.run(q, kv, 0.2)
    assert q_prepass.buffer_bytes == tuple(t.numel() * t.element_size() for t in (qq.q_q, qq.q_scale,
                                                                                     qq.q_dot_k_mean))
