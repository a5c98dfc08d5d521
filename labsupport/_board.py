"""The call board's format, in one place: the worker writes it (``Board``), the notebook reads it (``read_board``).

A call board is a small file shared by one worker and the notebook: a 4-byte little-endian length, then the
description of the ``torch.distributed`` call the worker was inside when the notebook asked, in UTF-8
("recv(src=1) of 4 float32"); length 0 means not asked yet, ``NO_CALL`` (all ones) asked but in no call. The
worker maps the file into memory, so posting is a memory copy, not a system call; the notebook reads it with an
ordinary ``read`` while the worker is blocked inside gloo (a deadlock report). No torch here: the notebook side imports this module.
"""

from __future__ import annotations

import mmap
import struct

__all__ = ["BOARD_SIZE", "NO_CALL", "Board", "new_board", "read_board", "board_answered"]

#: Bytes of a call board: the 4-byte length, then at most BOARD_SIZE - 4 bytes of text.
BOARD_SIZE = 1024
_HEADER = struct.Struct("<I")
NO_CALL = 0xFFFFFFFF


def new_board(path: str) -> None:
    """Create an empty board (all zeros: no call) at ``path``."""
    with open(path, "wb") as fh:
        fh.truncate(BOARD_SIZE)


class Board:
    """The writing side, in the worker: the file mapped into memory."""

    def __init__(self, path: str):
        with open(path, "r+b") as fh:
            self._mm = mmap.mmap(fh.fileno(), BOARD_SIZE)

    def post(self, text: str) -> None:
        data = text.encode("utf-8", "replace")[: BOARD_SIZE - _HEADER.size]
        self._mm[_HEADER.size : _HEADER.size + len(data)] = data
        self._mm[0 : _HEADER.size] = _HEADER.pack(len(data))  # the length last: a reader never sees half a text

    def clear(self) -> None:
        self._mm[0 : _HEADER.size] = _HEADER.pack(NO_CALL)

    def header(self) -> bytes:
        return bytes(self._mm[0 : _HEADER.size])


def read_board(path: str) -> str:
    """The call a worker is inside, from its board ("" when none, or when the board cannot be read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(BOARD_SIZE)
        (n,) = _HEADER.unpack(data[: _HEADER.size])
    except (OSError, struct.error):
        return ""
    if not 0 < n <= BOARD_SIZE - _HEADER.size:
        return ""
    return data[_HEADER.size : _HEADER.size + n].decode("utf-8", "replace")


def board_answered(path: str) -> bool:
    """Whether the worker has written its board since it started (a call, or that it is in none)."""
    try:
        with open(path, "rb") as fh:
            (n,) = _HEADER.unpack(fh.read(_HEADER.size))
    except (OSError, struct.error):
        return True  # nothing to wait for
    return n != 0
