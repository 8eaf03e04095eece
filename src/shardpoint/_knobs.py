"""The old flat view of the tunables, kept so that ``from ._knobs import knobs`` still
imports while branches written against it land; new code reads
:func:`shardpoint._options.current_options` (typed groups, environment read once).
"""

from __future__ import annotations

from types import SimpleNamespace

from ._options import current_options


def knobs() -> SimpleNamespace:
    """The options in effect, under the old flat names (``io_segment_bytes``, ...)."""
    o = current_options()
    return SimpleNamespace(
        write_threads=o.io.write_threads,
        read_threads=o.io.read_threads,
        io_segment_bytes=o.io.segment_bytes,
        collective_segment_bytes=o.collective.segment_bytes,
        cached_copy=o.io.cached_copy,
        direct_reads=o.io.direct_reads,
        staging_buffer_bytes=o.io.staging_buffer_bytes,
        max_header_bytes=o.io.max_header_bytes,
        max_json_bytes=o.io.max_json_bytes,
        verify_checksums=o.io.verify_checksums,
        collective_timeout_s=o.collective.timeout_s,
        remote_threads=o.remote.threads,
        remote_block_bytes=o.remote.block_bytes,
        remote_read_bytes=o.remote.read_bytes,
        remote_retries=o.remote.retries,
        remote_backoff_ms=o.remote.backoff_ms,
    )
