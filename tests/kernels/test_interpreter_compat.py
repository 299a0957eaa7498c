"""The shim that lets Triton 3.4-3.6's interpreters index with scalar tensors under NumPy 2.4 and
later (fsattn_diffusers/kernels/lowp.py), checked against stand-ins of both forms of the
interpreter's tensor patch (3.6 takes a scope that restores what it set; 3.4 and 3.5 do not), on
whichever Triton is installed."""

import numpy as np
import pytest
import triton
from triton.runtime import interpreter

from fsattn_diffusers.kernels import lowp

OLD_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7)


class _Scope:
    """3.6's scope: records each attribute's value before it is set, restores in reverse order."""

    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, value)

    def restore(self):
        while self.changes:
            obj, name, original = self.changes.pop()
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


class _Handle:
    def __init__(self, data):
        self.data = data


def _tensor_class():
    class Tensor:
        def __init__(self, data):
            self.handle = _Handle(data)

    return Tensor


def _patch_with_scope(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def _patch_without_scope(tensor):
    tensor.__index__ = lambda self: int(self.handle.data)


def _indexes_with_one_element_arrays(tensor):
    one_element = tensor(np.array([5], dtype=np.int32))
    return range(10)[one_element] == 5 and list(range(one_element)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("form", ["with_scope", "without_scope"])
def test_scalar_tensors_index_as_ints_after_the_shim(monkeypatch, form):
    original = _patch_with_scope if form == "with_scope" else _patch_without_scope
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", original)
    lowp._index_scalars_as_triton_37_does()
    lowp._index_scalars_as_triton_37_does()  # a second call must not wrap twice
    patch = interpreter._patch_lang_tensor
    assert patch is not original and patch.squeezes_scalar_index
    tensor = _tensor_class()
    if form == "with_scope":
        scope = _Scope()
        patch(tensor, scope)
        assert _indexes_with_one_element_arrays(tensor)
        scope.restore()
        assert "__index__" not in tensor.__dict__, "restoring must undo both the interpreter's and the shim's"
    else:
        patch(tensor)
        assert _indexes_with_one_element_arrays(tensor)


def test_the_shim_is_on_exactly_where_it_is_needed():
    wrapped = getattr(interpreter._patch_lang_tensor, "squeezes_scalar_index", False)
    assert wrapped == (lowp.IN_INTERPRETER and OLD_TRITON)
