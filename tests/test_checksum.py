"""The crc32c in use agrees with the reference package, whole and continued, and combines."""

from __future__ import annotations

import random

import crc32c as reference
import pytest

from shardpoint import _checksum


def test_fast_implementation_is_in_use():
    # fastcrc is a dependency: a silent fall back to the slower crc32c would cost load speed.
    assert _checksum.IMPLEMENTATION == "fastcrc"


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
