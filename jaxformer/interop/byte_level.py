"""Byte-level BPE's byte alphabet (GPT-2's scheme): every byte spelled as one printable character."""

from __future__ import annotations

import functools


@functools.cache
def byte_unicode_table() -> dict[int, str]:
    """The reversible byte -> printable character map byte-level BPE spells its tokens in: printable Latin-1
    bytes stand for themselves, the others for ``chr(256 + i)`` in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def byte_decoder() -> dict[str, int]:
    """:func:`byte_unicode_table` inverted: a byte-level BPE piece's characters -> its bytes."""
    return {c: b for b, c in byte_unicode_table().items()}
