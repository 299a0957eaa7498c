"""fsattn_diffusers/kernels/launch.py: when a launch may skip Triton's dispatcher, and what it then passes.

CPU only: a stand-in for a JIT function records which path each call took. The GPU tests (every
kernel test launches through Relaunch) check the launches themselves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

from fsattn_diffusers.kernels import launch
from fsattn_diffusers.kernels.launch import Relaunch


@dataclass
class _Param:
    name: str
    is_constexpr: bool = False
    has_default: bool = False
    default: object = None


class _Compiled:
    function = "handle"
    packed_metadata = ()

    def __init__(self, log):
        self.log = log
        self.runners_built = []

    def __getitem__(self, grid):
        self.runners_built.append(grid)
        def runner(*args, stream=None):
            self.log.append(("direct", grid, args) if stream is None else ("direct", grid, args, stream))
        return runner


class _JitFunction:
    """Signature (x_ptr, n, scale, BLOCK: constexpr, FLAG: constexpr = True)."""

    params = [_Param("x_ptr"), _Param("n"), _Param("scale"), _Param("BLOCK", True),
              _Param("FLAG", True, True, True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("triton", grid, args, meta))
            return _Compiled(self.log)
        return run


@contextlib.contextmanager
def _no_ptxas_change():
    yield {}


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(launch, "_on_cuda", lambda args: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # The installed Triton on a Hopper GPU would add its ptxas options (test below); the other
    # tests check the launch alone.
    monkeypatch.setattr(launch, "building_with_sm90_ptxas", _no_ptxas_change)
    return _JitFunction()


def _paths(fn):
    return [entry[0] for entry in fn.log]


def test_the_second_call_of_a_key_goes_straight_to_the_compiled_kernel_with_the_constexprs_in_order(jit):
    x, y = torch.zeros(64), torch.ones(64)
    relaunch = Relaunch(jit)
    relaunch[(4, 2)](x, 32, 0.5, BLOCK=16, num_warps=4)
    relaunch[(4, 2)](y, 32, 0.25, BLOCK=16, num_warps=4)  # another tensor and float: the same kernel
    assert _paths(jit) == ["triton", "direct"]
    # Grid padded to three dimensions; BLOCK given, FLAG from its default; options are not arguments.
    assert jit.log[1][1:] == ((4, 2, 1), (y, 32, 0.25, 16, True))


def test_tritons_path_states_fp_fusion_unless_the_launch_does(jit):
    # Triton 3.10 turns FP fusion off by default; the kernels' numerics assume it on (configs.FP_FUSION).
    x = torch.zeros(64)
    Relaunch(jit)[(4,)](x, 32, 0.5, BLOCK=16)
    Relaunch(jit)[(4,)](x, 32, 0.5, BLOCK=32, enable_fp_fusion=False)
    assert [entry[3]["enable_fp_fusion"] for entry in jit.log] == [True, False]


def test_the_compile_options_of_the_sm90_ptxas_reach_tritons_path_and_not_the_key(jit, monkeypatch):
    events = []

    class EventJit(_JitFunction):
        def __getitem__(self, grid):
            run = super().__getitem__(grid)

            def compile_and_launch(*args, **meta):
                events.append("triton")
                return run(*args, **meta)
            return compile_and_launch

    @contextlib.contextmanager
    def fake_building_with_sm90_ptxas():
        events.append("enter")
        yield {"ptx_version": 88}
        events.append("exit")

    monkeypatch.setattr(launch, "building_with_sm90_ptxas", fake_building_with_sm90_ptxas)
    fn, x = EventJit(), torch.zeros(64)
    relaunch = Relaunch(fn)
    relaunch[(4,)](x, 32, 0.5, BLOCK=16)
    relaunch[(4,)](x, 32, 0.5, BLOCK=16)
    assert _paths(fn) == ["triton", "direct"]  # the second call found the first's kernel
    assert fn.log[0][3] == dict(enable_fp_fusion=True, ptx_version=88, BLOCK=16)
    assert events == ["enter", "triton", "exit"]  # Triton's path ran inside the block, and only it


def test_each_grid_gets_its_own_runner_built_once(jit):
    x = torch.zeros(64)
    relaunch = Relaunch(jit)
    compiled = [relaunch[grid](x, 32, 0.5, BLOCK=16) for grid in [(4, 2), (4, 2), (8,), (4, 2), (8,)]]
    assert _paths(jit) == ["triton", "direct", "direct", "direct", "direct"]
    assert [entry[1] for entry in jit.log[1:]] == [(4, 2, 1), (8, 1, 1), (4, 2, 1), (8, 1, 1)]
    assert all(c is compiled[0] for c in compiled)
    assert compiled[0].runners_built == [(4, 2, 1), (8, 1, 1)]


@pytest.mark.parametrize("second", [
    dict(n=33),  # no longer a multiple of 16
    dict(first_n=17, n=1),  # as 17, not a multiple of 16, but Triton makes 1 a constant
    dict(n=1 << 40),  # 64-bit
    dict(x=torch.zeros(64)[1:]),  # 4 bytes off 16-byte alignment
    dict(x=torch.zeros(64, dtype=torch.float16)),
    dict(meta=dict(BLOCK=32, num_warps=4)),
    dict(meta=dict(BLOCK=16, num_warps=8)),
])
def test_any_change_triton_specialises_on_takes_its_path_again(jit, second):
    x = torch.zeros(64)
    relaunch = Relaunch(jit)
    relaunch[(1,)](x, second.get("first_n", 32), 0.5, BLOCK=16, num_warps=4)
    args = (second.get("x", x), second.get("n", 32), 0.5)
    relaunch[(1,)](*args, **second.get("meta", dict(BLOCK=16, num_warps=4)))
    assert _paths(jit) == ["triton", "triton"]


def test_a_runtime_parameter_passed_by_name_is_never_remembered(jit):
    x = torch.zeros(64)
    relaunch = Relaunch(jit)
    for scale in (0.5, 0.25):
        relaunch[(1,)](x, 32, scale=scale, BLOCK=16)
    assert _paths(jit) == ["triton", "triton"]
    assert jit.log[1][3]["scale"] == 0.25


def test_an_argument_of_unknown_type_takes_tritons_path(jit):
    relaunch = Relaunch(jit)
    for _ in range(2):
        relaunch[(1,)](torch.zeros(64), [1, 2], 0.5, BLOCK=16)
    assert _paths(jit) == ["triton", "triton"]


def test_cpu_tensors_always_take_tritons_path():
    # The interpreter and benchmarks/compile_check.py launch on CPU tensors: nothing is remembered.
    fn = _JitFunction()
    relaunch = Relaunch(fn)
    for _ in range(2):
        relaunch[(1,)](torch.zeros(64), 32, 0.5, BLOCK=16)
    assert _paths(fn) == ["triton", "triton"]


def test_a_bound_launch_goes_straight_to_the_compiled_kernel_after_its_first(jit):
    x, y = torch.zeros(64), torch.ones(64)
    bound = launch.BoundLaunch(jit, (4, 2), BLOCK=16, num_warps=4)
    bound(x, 32, 0.5)
    bound(y, 32, 0.25)
    bound(x, 32, 0.125)
    assert _paths(jit) == ["triton", "direct", "direct"]
    assert jit.log[0][1:] == ((4, 2), (x, 32, 0.5), dict(enable_fp_fusion=True, BLOCK=16, num_warps=4))
    assert jit.log[1][1:] == ((4, 2, 1), (y, 32, 0.25, 16, True))


def test_a_bound_launch_hands_the_runner_the_stream_it_is_given(jit):
    # One stream lookup per call of four launches, not one per launch (Triton's runner looks the
    # current stream up itself when given none).
    x = torch.zeros(64)
    bound = launch.BoundLaunch(jit, (1,), BLOCK=16)
    bound(x, 32, 0.5, stream=7)  # the first launch: Triton's own path, on the current stream
    bound(x, 32, 0.5, stream=7)
    bound(x, 32, 0.5)
    assert jit.log[1] == ("direct", (1, 1, 1), (x, 32, 0.5, 16, True), 7)
    assert jit.log[2] == ("direct", (1, 1, 1), (x, 32, 0.5, 16, True))


def test_a_bound_launch_shares_its_kernels_with_relaunch(jit):
    # One compilation per specialisation, whichever launched it first.
    x = torch.zeros(64)
    Relaunch.of(jit)[(1,)](x, 32, 0.5, BLOCK=16)
    launch.BoundLaunch(jit, (1,), BLOCK=16)(x, 32, 0.5)
    assert _paths(jit) == ["triton", "direct"]


def test_a_bound_launch_on_cpu_tensors_always_takes_tritons_path():
    fn = _JitFunction()
    bound = launch.BoundLaunch(fn, (1,), BLOCK=16)
    for _ in range(2):
        bound(torch.zeros(64), 32, 0.5)
    assert _paths(fn) == ["triton", "triton"]


def test_the_launch_key_tells_apart_dtypes_and_alignment_not_values():
    x = torch.zeros(64)
    assert launch.launch_key(x, None) == launch.launch_key(torch.ones(64), None) == (-1, ((torch.float32, True), None))
    assert launch.launch_key(x[1:], None) != launch.launch_key(x[4:], None)  # 4 bytes off, then 16 bytes off
    assert launch.launch_key(x.half()) != launch.launch_key(x)
    assert launch.launch_key(x, None) != launch.launch_key(x, x)


def test_carved_regions_are_consecutive_256_byte_aligned_and_inside_the_buffer():
    sizes = (1000, 16, 256, 1)
    buffer = torch.empty(launch.carved_bytes(sizes), dtype=torch.uint8)
    addresses = launch.carve(buffer, sizes)
    base = buffer.data_ptr()
    assert [a - base for a in addresses] == [0, 1024, 1280, 1536]
    assert launch.carved_bytes(sizes) == 1792 and addresses[-1] + sizes[-1] <= base + buffer.numel()
    assert all(isinstance(a, int) and a.data_ptr() == a for a in addresses)


def test_every_kernel_launch_site_goes_through_relaunch():
    # A launch written as kernel[grid](...) would pay Triton's dispatcher on every call.
    import pathlib
    import re

    root = pathlib.Path(launch.__file__).parent
    direct = [f"{p.name}: {m}" for p in root.glob("*.py") for m in re.findall(r"\b_\w+_kernel\[", p.read_text())]
    assert direct == []


def test_a_descriptor_after_the_first_is_what_triton_would_build_and_keeps_no_earlier_tensor():
    import gc
    import weakref

    gluon_common = pytest.importorskip("fsattn_diffusers.kernels.gluon_common",
                                       reason="this Triton has no Gluon (the Gluon kernels are off)")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    first = torch.zeros(256, 128, dtype=torch.int8)
    gluon_common._descriptor(first, (64, 128), gl.int8)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None, "a cached descriptor field holds the first tensor"
    second = torch.zeros(512, 128, dtype=torch.int8)
    fast = gluon_common._descriptor(second, (64, 128), gl.int8)
    built = TensorDescriptor.from_tensor(second, [64, 128], gl.NVMMASharedLayout.get_default_for([64, 128], gl.int8))
    assert vars(fast).keys() == vars(built).keys()
    assert fast.base is second
    for name, value in vars(built).items():
        if name != "base":
            assert list(getattr(fast, name)) == list(value) if name in ("shape", "strides") else \
                getattr(fast, name) == value, name
    with pytest.raises(ValueError, match="contiguous"):
        gluon_common._descriptor(torch.zeros(128, 512, dtype=torch.int8).t(), (64, 128), gl.int8)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_calls_that_skip_the_dispatcher_give_the_first_calls_bytes(head_dim):
    from fsattn_diffusers import fsattn

    gen = torch.Generator(device="cuda").manual_seed(5)
    n = 1000 * 4 * head_dim
    flat = [torch.randn(n + 8, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]

    def call(offset):
        q, k, v = (t[offset:offset + n].view(1, 1000, 4, head_dim) for t in flat)
        return fsattn(q, k, v)

    first = call(0)  # Triton's path (and compilation)
    unaligned = call(1)  # 2 bytes off: a new specialisation, Triton's path again
    assert torch.equal(call(0), first)  # the direct path
    assert torch.equal(call(1), unaligned)
    q, k, v = (t[1:1 + n].view(1, 1000, 4, head_dim).clone() for t in flat)
    torch.testing.assert_close(fsattn(q, k, v), unaligned)  # the same values, aligned
