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
ahead-of-time compilation, which launch nothing, always take Triton's path).
"""

from __future__ import annotations

import functools

import torch

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
    """``Relaunch(fn)[grid](*args, **meta)`` launches as ``fn[grid](*args, **meta)`` does.

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

    def _launch(self, grid, *args, **meta):
        if not self._params or not isinstance(grid, tuple) or not 1 <= len(grid) <= 3 or not _on_cuda(args):
            return self.fn[grid](*args, **meta)
        keys = _args_key(args)
        if _UNKEYED in keys:
            return self.fn[grid](*args, **meta)
        key = (torch.cuda.current_device(), keys, tuple(meta.items()))
        try:
            entry = self._compiled.get(key)
        except TypeError:  # a keyword argument that cannot be hashed: not keyed
            return self.fn[grid](*args, **meta)
        if entry is not None:
            compiled, tail, runners = entry
            runner = runners.get(grid)
            if runner is None:  # CompiledKernel[grid] builds a closure per call: kept per grid
                if len(runners) >= MAX_REMEMBERED:
                    runners.clear()
                runner = runners[grid] = compiled[grid + (1,) * (3 - len(grid))]
            runner(*args, *tail)
            return compiled
        compiled = self.fn[grid](*args, **meta)
        tail = self._tail(len(args), meta)
        if tail is not None and hasattr(compiled, "function") and hasattr(compiled, "packed_metadata"):
            if len(self._compiled) >= MAX_REMEMBERED:
                self._compiled.clear()
            self._compiled[key] = (compiled, tail, {})
        return compiled


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for host-side sizes (``triton.cdiv`` is a constexpr function from Triton 3.9 on,
    which costs microseconds a call on the host)."""
    return -(-a // b)
