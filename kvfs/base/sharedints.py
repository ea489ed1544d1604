"""One int object for each of the few values that many files repeat.

Python shares only the ints -5..256 itself; any other int is an object of its
own (32 to 48 bytes in the allocator). A million files of one size each kept a
4096 of their own as the file's size and again as its block's length, and a
mode each: about 100 MB. ``shared(value)`` returns the first equal object it
saw, for up to ``LIMIT`` distinct values; past that it returns ``value``
itself, so a workload of many sizes grows no table.
"""
from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")

LIMIT = 4096
_seen: dict[Any, Any] = {}         # int -> the same int


def shared(value: T) -> T:
    if type(value) is not int:          # 1 == True == 1.0: share only ints, with ints
        return value
    hit = _seen.get(value)
    if hit is not None:
        return hit
    if len(_seen) < LIMIT:
        _seen[value] = value
    return value
