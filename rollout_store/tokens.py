"""Compact binary format of token ids and logprobs in the store.

Token ids are little-endian signed 32-bit integers (`<i4`), logprobs little-endian 32-bit floats (`<f4`),
concatenated without header: the byte length divided by four is the count. The same bytes live in a SQLite
BLOB or a PostgreSQL BYTEA, and decode with one `numpy.frombuffer` call (no per-token Python loop).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype=ID_DTYPE).tobytes()


def unpack_ids(blob: bytes | None) -> np.ndarray:
    if not blob:
        return np.empty(0, dtype=ID_DTYPE)
    return np.frombuffer(blob, dtype=ID_DTYPE)


def pack_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def unpack_logprobs(blob: bytes | None) -> np.ndarray:
    if not blob:
        return np.empty(0, dtype=LOGPROB_DTYPE)
    return np.frombuffer(blob, dtype=LOGPROB_DTYPE)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays, vectorised."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n
