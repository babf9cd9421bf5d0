"""Top-K log-probs of a generation, and their compact binary form.

For every output token the local engine can keep the ``k`` most likely token ids under the raw model
distribution at temperature 1 and their log-probs (``log_softmax(logits)``), sorted by log-prob, highest first.
Distillation-style objectives need them; they come out of the forward pass that sampled the token.

Storage. ``K=20`` on a 512-token reply is 10,240 (id, log-prob) pairs: as JSON lists that is ~250 KB, so the record
store keeps them as one binary column (``records.top_k``) holding :meth:`TopK.pack`:

* header ``b"RTK1"``, then ``uint32`` token count ``n`` and ``uint16`` ``k`` (little-endian);
* ``n*k`` ids as ``int32`` and ``n*k`` log-probs as ``float16`` (rounded: ~3 significant digits, enough for a
  teacher distribution; the sampled token's exact log-prob stays in ``output_logprobs``);
* both arrays *byte-shuffled* (all first bytes, then all second bytes...) and the whole body zlib-compressed. The high
  bytes of ids below a vocabulary of 2^24 are nearly constant and a float16's sign/exponent byte varies little, so
  shuffling lets zlib remove them: random data from a 151k vocabulary packs to ~4 bytes a pair (about 41 KiB for
  512x20), real generations less. Base64 inside the JSON payload would add a third again and break the 64 KiB bound
  a 512x20 record must meet, hence a binary column rather than a payload field.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from array import array
from dataclasses import dataclass
from typing import Any

from reef_core.errors import ValidationFailed

MAGIC = b"RTK1"
_HEADER = struct.Struct("<4sIH")
#: Largest ``k`` the engine captures and the format stores (OpenAI's ``top_logprobs`` stops at 20 too; a
#: larger ``k`` costs generation time and storage for little signal).
MAX_K = 64
#: float16's most negative finite value; lower log-probs (probability ~0) are stored as it.
_F16_MIN = -65504.0


def _shuffle(raw: bytes, width: int) -> bytes:
    return b"".join(raw[i::width] for i in range(width))


def _unshuffle(raw: bytes, width: int) -> bytes:
    plane = len(raw) // width
    out = bytearray(len(raw))
    for i in range(width):
        out[i::width] = raw[i * plane:(i + 1) * plane]
    return bytes(out)


@dataclass(frozen=True)
class TopK:
    """``k`` candidates per output token, flat and row-major: token ``t``'s are ``ids[t*k:(t+1)*k]`` with
    ``logprobs[t*k:(t+1)*k]`` (highest first)."""

    k: int
    ids: list[int]
    logprobs: list[float]

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ValidationFailed(f"top_k.k must be an integer from 1 to {MAX_K}", field="top_k")
        if len(self.ids) != len(self.logprobs) or len(self.ids) % self.k:
            raise ValidationFailed("top_k: ids and logprobs must both hold k entries per token", field="top_k")

    @property
    def tokens(self) -> int:
        """Number of output tokens covered."""
        return len(self.ids) // self.k

    def row(self, t: int) -> tuple[list[int], list[float]]:
        """``(ids, logprobs)`` of output token ``t``."""
        return self.ids[t * self.k:(t + 1) * self.k], self.logprobs[t * self.k:(t + 1) * self.k]

    def pack(self) -> bytes:
        """The compact binary form (see the module docstring); lossy only in the log-probs' float16 rounding."""
        ids = array("i", self.ids)  # OverflowError for an id outside int32: no vocabulary is that large
        lps = [max(_F16_MIN, float(x)) if not math.isnan(x) else x for x in self.logprobs]
        if sys.byteorder != "little":
            ids.byteswap()
        body = _shuffle(ids.tobytes(), 4) + _shuffle(struct.pack(f"<{len(lps)}e", *lps), 2)
        return _HEADER.pack(MAGIC, self.tokens, self.k) + zlib.compress(body, 6)

    @classmethod
    def unpack(cls, data: bytes) -> "TopK":
        """Inverse of :meth:`pack`; :class:`ValidationFailed` for bytes that are not a packed TopK."""
        try:
            magic, n, k = _HEADER.unpack_from(data)
            if magic != MAGIC:
                raise ValueError("bad magic")
            body = zlib.decompress(bytes(data[_HEADER.size:]))
            count = n * k
            if len(body) != count * 6:
                raise ValueError("length mismatch")
            ids = array("i")
            ids.frombytes(_unshuffle(body[:count * 4], 4))
            if sys.byteorder != "little":
                ids.byteswap()
            lps = struct.unpack(f"<{count}e", _unshuffle(body[count * 4:], 2))
        except (struct.error, zlib.error, ValueError) as exc:
            raise ValidationFailed(f"top_k: not a packed top-K block ({exc})", field="top_k") from exc
        return cls(k=k, ids=ids.tolist(), logprobs=list(lps))

    @classmethod
    def coerce(cls, value: Any) -> "TopK | None":
        """A :class:`TopK` from what a token-data dict may carry: a TopK, its packed bytes, or ``None``."""
        if value is None or isinstance(value, TopK):
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return cls.unpack(bytes(value))
        raise ValidationFailed("top_k must be a TopK or its packed bytes", field="top_k")

