"""Builds the optional C extension; everything else is declared in pyproject.toml.

``shardpoint._native`` holds the GIL-free read/write loops and a folding crc32c. It is
optional: where it does not build (no compiler, not x86-64 with GCC or Clang), the install
still succeeds and shardpoint runs the same loops in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardpoint._native",
            sources=["src/shardpoint/_native.c"],
            depends=["src/shardpoint/_native_fold.h"],
            extra_compile_args=["-O3", "-Wall", "-Wno-unused-function"],
            optional=True,
        )
    ]
)
