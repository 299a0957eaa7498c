"""Launching a kernel again without Triton's dispatcher.

``fn[grid](*args, **meta)`` on a ``@triton.jit`` or ``@gluon.jit`` function binds and specialises
every argument, builds the cache key, checks the globals the kernel read and only then launches:
tens of microseconds of host time per launch, four launches per fsattn call. :class:`Relaunch`
does that once per specialisation and afterwards calls the compiled kernel directly
(``CompiledKernel[grid](*args)``, the same call Triton makes at the end of its own path).

Correctness rests on the key: it must tell apart every pair of calls that Triton would compile
differently. It is built to be finer than Triton's own specialisation (Triton 3.6-3.9): tensors
by dtype and 16-byte alignment, integers by value (Triton looks at ``== 1``, divisibility by 16
and width; the value itself is cheaper to key on, and a model calls few shapes), floats as one
type, descriptors by element type, block, layout, alignment and divisibility of shape and
strides, the keyword arguments (constexprs and launch options) by value, and the current device.
An argument of any other type is not keyed: that call, and every call with it, takes Triton's path.
The first call of each key also takes Triton's path, so compilation, its errors and the disk
cache are Triton's own; only calls on CUDA tensors are remembered (the interpreter and
ahead-of-time compilation, which launch nothing, always take Triton's path). Triton's path is
given two things: FP fusion, stated (configs.FP_FUSION, unless the caller passes
``enable_fp_fusion``, which is then keyed as every keyword is), and under Triton 3.9 on sm_90 the
ptxas of :mod:`.toolchain` with its PTX version.
"""

from __future__ import annotations

import functools

import torch

from .configs import FP_FUSION
from .toolchain import building_with_sm90_ptxas

_UNKEYED = object()
# Keys remembered per kernel before starting afresh (each new one costs one pass through Triton).
MAX_REMEMBERED = 512


def _other_arg_key(a):
    """The key of an argument that is not an int, float or tensor (`_args_key` keys those)."""
    cls = a.__class__
    if cls is bool:
        return ("bool", a)
    if a is None:
        return None
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # a TMA tensor descriptor
        return (cls, base.dtype, base.data_ptr() & 15 == 0, tuple(a.block_shape), getattr(a, "layout", None),
                getattr(a, "padding", None), tuple(s % 16 == 0 for s in a.strides),
                tuple(s % 16 == 0 for s in a.shape))
    return _UNKEYED


def _args_key(args, _tensor=torch.Tensor):
    # Inline for the common types: this runs for every argument of every launch.
    keys = []
    for a in args:
        cls = a.__class__
        if cls is int:
            keys.append(a)
        elif cls is _tensor or isinstance(a, _tensor):
            keys.append((a.dtype, a.data_ptr() & 15 == 0))
        elif cls is float:
            keys.append(float)
        else:
            keys.append(_other_arg_key(a))
    return tuple(keys)


def _on_cuda(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.is_cuda
        base = getattr(a, "base", None)
        if isinstance(base, torch.Tensor):
            return base.is_cuda
    return False


class Relaunch:
    """``Relaunch(fn)[grid](*args, **meta)`` launches as ``fn[grid](*args, **meta)`` does, with
    the two additions to Triton's path that the module docstring names.

    `args` are the kernel's runtime parameters, positionally and in order; `meta` holds its
    constexprs and launch options (``num_warps``, ...) by name. Calls that pass a runtime
    parameter by name, or leave one to its default, always take Triton's path.
    """

    @classmethod
    def of(cls, fn) -> "Relaunch":
        """The one :class:`Relaunch` of `fn`, kept on it (a dict keyed by JIT functions would hash
        their source on every lookup)."""
        launcher = getattr(fn, "_fsattn_relaunch", None)
        if launcher is None:
            launcher = cls(fn)
            fn._fsattn_relaunch = launcher
        return launcher

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)
        self._params = [(p.name, p.is_constexpr, p.default if p.has_default else _UNKEYED) for p in params or ()]
        self._compiled = {}

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _tail(self, n_args: int, meta: dict):
        """The values after the first `n_args` parameters, in the signature's order, or None when
        one of them is a runtime parameter (its value would change from call to call)."""
        tail = []
        for name, is_constexpr, default in self._params[n_args:]:
            if not is_constexpr:
                return None
            value = meta.get(name, default)
            if value is _UNKEYED:
                return None
            tail.append(value)
        return tuple(tail)

    def _key(self, grid, args, meta):
        """The key of a launch, or None where it takes Triton's path every time."""
        if not self._params or not isinstance(grid, tuple) or not 1 <= len(grid) <= 3 or not _on_cuda(args):
            return None
        keys = _args_key(args)
        if _UNKEYED in keys:
            return None
        key = (torch.cuda.current_device(), keys, tuple(meta.items()))
        try:
            hash(key)
        except TypeError:  # a keyword argument that cannot be hashed: not keyed
            return None
        return key

    def runner(self, grid, args, meta):
        """``(runner, tail)`` such that ``runner(*args, *tail)`` launches these arguments as
        ``self[grid](*args, **meta)`` would, once a launch of theirs has compiled; else None."""
        key = self._key(grid, args, meta)
        entry = None if key is None else self._compiled.get(key)
        return None if entry is None else (self._runner_of(entry, grid), entry[1])

    @staticmethod
    def _runner_of(entry, grid):
        compiled, _, runners = entry
        runner = runners.get(grid)
        if runner is None:  # CompiledKernel[grid] builds a closure per call: kept per grid
            if len(runners) >= MAX_REMEMBERED:
                runners.clear()
            runner = runners[grid] = compiled[grid + (1,) * (3 - len(grid))]
        return runner

    def _triton_launch(self, grid, args, meta):
        """Triton's own path, which compiles on a first launch: with FP fusion stated (its default
        turns off in Triton 3.10; configs.FP_FUSION where the caller's `meta` does not say) and
        the ptxas that :func:`.toolchain.building_with_sm90_ptxas` picks. Neither default enters
        the key: a kernel once compiled keeps what it was built with for the rest of the process."""
        with building_with_sm90_ptxas() as options:
            return self.fn[grid](*args, **{"enable_fp_fusion": FP_FUSION, **options, **meta})

    def _launch(self, grid, *args, **meta):
        key = self._key(grid, args, meta)
        if key is None:
            return self._triton_launch(grid, args, meta)
        entry = self._compiled.get(key)
        if entry is not None:
            self._runner_of(entry, grid)(*args, *entry[1])
            return entry[0]
        compiled = self._triton_launch(grid, args, meta)
        tail = self._tail(len(args), meta)
        if tail is not None and hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
            if len(self._compiled) >= MAX_REMEMBERED:
                self._compiled.clear()
            self._compiled[key] = (compiled, tail, {})
        return compiled


class BoundLaunch:
    """One kernel's launch with its grid and keyword arguments fixed, for a caller that launches it
    again and again with arguments that Triton specialises alike (the same dtypes and integer
    values, tensors aligned alike): the per-shape launch objects of :mod:`.quantize` and the
    forward modules, which their caches key so.

    ``bound(*args)`` launches as ``Relaunch.of(fn)[grid](*args, **meta)``. The first launch takes
    that path (compiling there); later ones call the compiled kernel's runner directly, without
    keying the arguments again: keeping them alike is the caller's side of the contract. Where
    the first launch is not remembered (CPU tensors, the interpreter, an unkeyed argument), every
    launch takes Relaunch's path.
    """

    __slots__ = ("_relaunch", "_grid", "_meta", "_fast")

    def __init__(self, fn, grid: tuple, **meta):
        self._relaunch = Relaunch.of(fn)
        self._grid = grid
        self._meta = meta
        self._fast = None

    @property
    def direct(self) -> bool:
        """Whether launches go straight to the compiled kernel (after a remembered first launch):
        only then may arguments be :class:`Address` es instead of tensors."""
        return self._fast is not None

    def __call__(self, *args, stream=None):
        """Launch on `stream` (a raw CUDA stream handle, ``current_stream(device)``; default: the
        current stream of the current device, looked up at each launch). The first launch, and
        every launch that is not :attr:`direct`, is on the current stream whatever `stream` says:
        callers pass the current one."""
        fast = self._fast
        if fast is not None:
            if stream is None:
                fast[0](*args, *fast[1])
            else:
                fast[0](*args, *fast[1], stream=stream)
            return
        self._relaunch._launch(self._grid, *args, **self._meta)
        self._fast = self._relaunch.runner(self._grid, args, self._meta)


class Address(int):
    """A device address where a kernel takes a pointer. Triton's launchers (3.6-3.9) take an int
    argument as the address itself, where a tensor costs a ``data_ptr()`` call and a driver query;
    ``data_ptr()`` makes it a TMA descriptor's base. Only for launches that skip Triton's
    specialisation (:class:`BoundLaunch` after its first launch, which saw tensors)."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


def carve(buffer: torch.Tensor, sizes) -> list:
    """:class:`Address` es of consecutive regions of `sizes` bytes in `buffer` (uint8, at least
    :func:`carved_bytes` of `sizes` long), each 256-byte aligned as a fresh allocation is."""
    base = buffer.data_ptr()
    addresses = []
    for size in sizes:
        addresses.append(Address(base))
        base += -(-size // 256) * 256
    return addresses


def carved_bytes(sizes) -> int:
    """The bytes :func:`carve` takes for regions of `sizes` bytes."""
    return sum(-(-size // 256) * 256 for size in sizes)


def current_stream(device: int):
    """The raw handle of the current CUDA stream of `device`, as Triton's launches look it up
    (one lookup for a call's launches instead of one each)."""
    return _stream_lookup()(device)


@functools.lru_cache(maxsize=None)
def _stream_lookup():
    from triton.runtime import driver  # imported on first use: this module imports without Triton

    return driver.active.get_current_stream


def launch_key(*tensors, device=None) -> tuple:
    """What a cache of :class:`BoundLaunch` users must key on besides shapes and strides: the
    current CUDA device (a compiled kernel is loaded per device; `device` where the caller knows
    it), and each tensor's dtype and whether it is 16-byte aligned, as Triton specialises pointers
    (None stays None)."""
    on_cuda = device is not None
    keys = []
    for t in tensors:
        if t is None:
            keys.append(None)
        else:
            on_cuda = on_cuda or t.is_cuda
            keys.append((t.dtype, t.data_ptr() & 15 == 0))
    if device is None:
        device = torch.cuda.current_device() if on_cuda else -1
    return (device, tuple(keys))


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for host-side sizes (``triton.cdiv`` is a constexpr function from Triton 3.9 on,
    which costs microseconds a call on the host)."""
    return -(-a // b)
