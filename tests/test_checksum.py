"""The crc32c in use agrees with the reference package, whole and continued, and combines."""

from __future__ import annotations

import platform
import random

import crc32c as reference
import pytest

from shardpoint import _checksum


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the C extension's crc32c is x86-64 only")
def test_fast_implementation_is_in_use():
    # The extension builds on install; a silent fall back to Python loops would cost load speed.
    assert _checksum.NATIVE is not None, "shardpoint._native did not build; see setup.py"
    flags = _cpu_flags()
    if {"vpclmulqdq", "avx512f", "avx512bw", "avx512vl"} <= flags:
        want = "vpclmulqdq"
    elif {"vpclmulqdq", "avx2"} <= flags:  # 256-bit folding (AMD Zen 3, AVX-512 off)
        want = "vpclmulqdq-256"
    else:
        want = "pclmulqdq"
    if "pclmulqdq" in flags:
        in_use = _checksum.IMPLEMENTATION
        assert in_use == f"shardpoint._native ({want})"


@pytest.mark.parametrize("length", [0, 1, 7, 63, 64, 65, 4095, 4096, 100_003, 1 << 20])
def test_crc32c_matches_the_reference(length):
    data = random.Random(length).randbytes(length)
    assert _checksum.crc32c(data) == reference.crc32c(data)
    cut = length // 3
    assert _checksum.crc32c(data[cut:], _checksum.crc32c(data[:cut])) == reference.crc32c(data)
    assert _checksum.crc32c(memoryview(data)) == reference.crc32c(data)


def test_known_check_value():
    assert _checksum.crc32c(b"123456789") == 0xE3069283


def test_combine_of_pieces_equals_the_whole():
    data = random.Random(0).randbytes(300_000)
    a, b = data[:123_457], data[123_457:]
    combined = _checksum.crc32c_combine(_checksum.crc32c(a), _checksum.crc32c(b), len(b))
    assert combined == reference.crc32c(data)
