"""Triton kernels of fsattn, installed as ``fsattn_diffusers.kernels``; they know nothing of diffusers.

Import the submodules directly (``fsattn_diffusers.kernels.fsattn_fwd``, ``.quantize``,
``.configs``): this package imports nothing itself, so that ``configs`` stays importable on
machines without Triton.
"""
