"""Triton and Gluon kernels of fsattn; they import nothing of diffusers or of the rest of the package.

Import the submodules directly (``fsattn_diffusers.kernels.fsattn_fwd``, ``.quantize``,
``.configs``): this package imports nothing itself, so that ``configs`` stays importable on
machines without Triton.
"""
