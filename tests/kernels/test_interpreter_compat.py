"""The shim that lets Triton 3.6's interpreter index with scalar tensors under NumPy 2.4 and later
(fsattn_diffusers/kernels/lowp.py). It runs only on 3.6 and earlier; here it is checked against a
stand-in of the interpreter's tensor patch, on whichever Triton is installed."""

import numpy as np
from triton.runtime import interpreter

from fsattn_diffusers.kernels import lowp


class _Scope:
    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)


class _Handle:
    def __init__(self, data):
        self.data = data


def _patch_as_triton_36(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def test_scalar_tensors_index_as_ints_after_the_shim(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", _patch_as_triton_36)
    lowp._index_scalars_as_triton_37_does()
    lowp._index_scalars_as_triton_37_does()  # a second call must not wrap twice
    patch = interpreter._patch_lang_tensor
    assert patch is not _patch_as_triton_36 and patch.squeezes_scalar_index

    class Tensor:
        def __init__(self, data):
            self.handle = _Handle(data)

    scope = _Scope()
    patch(Tensor, scope)
    one_element = Tensor(np.array([5], dtype=np.int32))
    assert range(10)[one_element] == 5 and list(range(one_element)) == [0, 1, 2, 3, 4]
    # The shim's __index__ is set after the interpreter's own, so restoring in reverse order
    # (as the interpreter's scope does) puts back the original.
    assert [name for _, name, _ in scope.changes] == ["__index__", "__index__"]
