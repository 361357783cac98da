"""Triton kernels and their launchers, installed as ``mpgemm.kernels``.

Each module here imports triton (the package itself does not), so the ``mpgemm`` API
imports them lazily, where a tensor takes the kernel path.
"""
