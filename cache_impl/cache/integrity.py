"""Block file format, checksums and verification (where the files live: `cache_impl.cache.blockfiles`).

A block file is a 4096-byte header followed by the payload (the block's KV
bytes), padded to a multiple of 4096 bytes so it can be read with O_DIRECT:

    magic "KVGBLOCK" | format u16 | reserved u16 | fingerprint 16 | key 16 |
    payload bytes u64 | payload xxh3-128 16 | header xxh3-64 8 | zero padding

Every read checks all of it; any mismatch is reported as a reason string,
and the caller treats the block as a miss.
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import xxhash

from cache_impl.cache.keys import FORMAT_VERSION

MAGIC = b"KVGBLOCK"
ALIGN = 4096
HEADER_BYTES = ALIGN
_FIELDS = struct.Struct("<8sHH16s16sQ16s")
_HEADER_CHECK = struct.Struct("<Q")
IOV_MAX = 1024  # the most buffers one preadv (or one AIO vectored read) takes: Linux's UIO_MAXIOV

# Reasons a stored block is refused; used as metric labels.
MISSING = "missing"
SHORT_READ = "short_read"
BAD_HEADER = "bad_header"
WRONG_FINGERPRINT = "fingerprint"
WRONG_KEY = "key"
WRONG_SIZE = "size"
BAD_CHECKSUM = "checksum"
IO_ERROR = "io_error"


def checksum(data) -> bytes:
    """128-bit checksum of a buffer (xxh3-128; releases the GIL on large buffers)."""
    return xxhash.xxh3_128_digest(data)


def checksum_spans(spans: Sequence) -> bytes:
    """The checksum of the buffers' bytes one after another (the same digest as of their concatenation;
    the streaming hash releases the GIL in each update too)."""
    if len(spans) == 1:
        return checksum(spans[0])
    state = xxhash.xxh3_128()
    for span in spans:
        state.update(span)
    return state.digest()


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def file_nbytes(payload_nbytes: int) -> int:
    """Size on disk of a block file whose payload is `payload_nbytes`."""
    return HEADER_BYTES + padded(payload_nbytes)


def encode_header(fingerprint: bytes, key: bytes, payload_nbytes: int, payload_checksum: bytes) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, payload_nbytes, payload_checksum)
    header = fields + _HEADER_CHECK.pack(xxhash.xxh3_64_intdigest(fields))
    return header + bytes(HEADER_BYTES - len(header))


def verify_header(header, fingerprint: bytes, key: bytes, payload_nbytes: int) -> tuple[str | None, bytes]:
    """Check a header against what the reader expects; returns (reason or None, payload checksum)."""
    header = bytes(header[: _FIELDS.size + _HEADER_CHECK.size])
    if len(header) < _FIELDS.size + _HEADER_CHECK.size:
        return SHORT_READ, b""
    fields = header[: _FIELDS.size]
    (stored_check,) = _HEADER_CHECK.unpack(header[_FIELDS.size :])
    magic, version, _, stored_fp, stored_key, stored_nbytes, payload_sum = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT_VERSION or stored_check != xxhash.xxh3_64_intdigest(fields):
        return BAD_HEADER, b""
    if stored_fp != fingerprint:
        return WRONG_FINGERPRINT, b""
    if stored_key != key:
        return WRONG_KEY, b""
    if stored_nbytes != payload_nbytes:
        return WRONG_SIZE, b""
    return None, payload_sum


def stored_payload_nbytes(header) -> int | None:
    """The payload size a header claims (None when the header is too short to say)."""
    if len(header) < _FIELDS.size:
        return None
    return _FIELDS.unpack(bytes(header[: _FIELDS.size]))[5]


def verify_read(header, payload: Sequence, got: int, fingerprint: bytes, key: bytes, payload_nbytes: int) -> str | None:
    """Check a block read as `header` + `payload` buffers (`got` bytes in all): None when it is whole and ours."""
    if got < HEADER_BYTES + payload_nbytes:
        return SHORT_READ
    reason, expected_sum = verify_header(header, fingerprint, key, payload_nbytes)
    if reason:
        return reason
    return None if checksum_spans(payload) == expected_sum else BAD_CHECKSUM


def verify_open_file(fd: int, fingerprint: bytes, key: bytes) -> tuple[str | None, int]:
    """Check a whole open block file without knowing the layout (the header gives the payload size).

    Returns (reason or None, bytes read).
    """
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    except OSError:
        return IO_ERROR, 0
    nbytes = stored_payload_nbytes(data[:HEADER_BYTES])
    if nbytes is None or len(data) < HEADER_BYTES:
        return SHORT_READ, len(data)
    reason, expected_sum = verify_header(data[:HEADER_BYTES], fingerprint, key, nbytes)
    if reason:
        return reason, len(data)
    if len(data) < file_nbytes(nbytes):
        return SHORT_READ, len(data)
    if checksum(memoryview(data)[HEADER_BYTES : HEADER_BYTES + nbytes]) != expected_sum:
        return BAD_CHECKSUM, len(data)
    return None, len(data)


def _views(buffers: Sequence) -> list[memoryview]:
    return [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first n bytes from a list of buffers (after a partial readv/writev)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def write_all(fd: int, buffers: Sequence) -> int:
    """writev until every byte of every buffer is written."""
    views, written = _views(buffers), 0
    while views:
        n = os.writev(fd, views)
        written += n
        _advance(views, n)
    return written


def read_all(fd: int, buffers: Sequence) -> int:
    """preadv from offset 0 until the buffers are full or the file ends; bytes read."""
    views, total = _views(buffers), 0
    while views:
        n = os.preadv(fd, views[:IOV_MAX], total)
        if n == 0:
            break
        total += n
        _advance(views, n)
    return total
