"""Conversions to the 8- and 16-bit formats of the PV product, correct under Triton's interpreter too.

Triton 3.6's interpreter (the CPU test path) converts float32 to FP8 e4m3 without carrying a
rounding overflow into the exponent (125.5 becomes 64, not 128), truncates float32 to bf16,
and computes ``tl.dot`` of bf16 operands as garbage. With ``SOFT_ROUND`` the value is first
rounded to the target grid (nearest even) with integer arithmetic, so the conversion that
follows is exact, and dots take float32 operands. On a GPU ``SOFT_ROUND`` is False and these
are the plain hardware conversions. Importing this module under the interpreter also lets
Triton 3.4-3.6's interpreters index with scalar tensors under NumPy 2.4 (below).
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl
from triton import knobs

from .configs import triton_release

# Read once at import, as Triton's own reading of TRITON_INTERPRET (any of its true spellings).
IN_INTERPRETER = bool(knobs.runtime.interpret)


def _index_scalars_as_triton_37_does() -> None:
    """Let Triton 3.4-3.6's interpreter run these kernels under NumPy 2.4 and later.

    Those interpreters turn a scalar tensor used as an index or a ``tl.range`` bound into a Python
    int by ``int()`` of its data, a one-element 1-d array, which NumPy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"); 3.7 squeezes the array first. This
    wraps the interpreter's tensor patch to do as 3.7 does. 3.6's patch takes the scope that
    restores what it set (the shim's ``__index__`` is set after the interpreter's own, so it is
    undone first); 3.4's and 3.5's take the tensor class alone.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_scalar_index", False):
        return

    def index(self):
        return int(self.handle.data.squeeze())

    if len(inspect.signature(patch).parameters) == 2:
        def patch_lang_tensor(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", index)
    else:
        def patch_lang_tensor(tensor):
            patch(tensor)
            tensor.__index__ = index

    patch_lang_tensor.squeezes_scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_RELEASE = triton_release()
if IN_INTERPRETER and _RELEASE is not None and _RELEASE < (3, 7):
    _index_scalars_as_triton_37_does()

# Globals a @triton.jit function reads must be tl.constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _round_to_mantissa(x, DROP: tl.constexpr):
    """Round float32 `x` to nearest-even with the low DROP mantissa bits cleared."""
    bits = x.to(tl.int32, bitcast=True)
    half = (1 << (DROP - 1)) - 1
    bits = (bits + half + ((bits >> DROP) & 1)) & (-(1 << DROP))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_low_precision(x, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """`x.to(DTYPE)` for float32 `x` within DTYPE's range."""
    if SOFT_ROUND:
        if DTYPE == tl.float8e4nv:
            normal = _round_to_mantissa(x, 20)
            subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2**14 has an ulp of 2**-9, e4m3's subnormal step
            x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
        elif DTYPE == tl.bfloat16:
            x = _round_to_mantissa(x, 16)
        elif DTYPE == tl.float16:
            x = _round_to_mantissa(x, 13)
    return x.to(DTYPE)


@triton.jit
def dot_lowp(a, b, acc, SOFT_ROUND: tl.constexpr):
    """`tl.dot(a, b, acc)` for the 8/16-bit PV operands (float32 operands under the interpreter)."""
    if SOFT_ROUND:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)
