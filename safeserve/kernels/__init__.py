"""Triton kernels with torch reference paths, and their tuned tile configs (data in configs/).

Importing this package never needs Triton: the kernels are defined only where Triton imports,
and every entry point falls back to its torch reference elsewhere.
"""
