"""Triton kernels and their launchers, installed as ``mpgemm.kernels``.

Importing this package imports triton, so the ``mpgemm`` API imports it lazily.
"""
