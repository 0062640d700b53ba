"""Seeded mutations of JSON documents and bytes: structural (fields deleted, retyped, huge,
nested, swapped, renamed) and byte-level (truncated, flipped, spliced)."""

from __future__ import annotations

import copy
import json
import random
import re
from typing import Any

_INTS = (0, 1, -1, 2, 3, 7, 255, 256, 257, 4095, 4096, 4097, 1 << 31, 1 << 32, (1 << 40) + 8, (1 << 53) + 1,
         1 << 56, (1 << 56) + 4096, 1 << 62, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63), -(1 << 63) - 1, 10 ** 40)
_ATOMS = (None, True, False, "", "x", "float32", "bfloat16", "int8", "experts", "non_experts", "rank-0", "..",
          "../../etc", "a/b", "\udcff", "\x00", "0" * 64, "g" * 16, 0.5, -0.0, 1e308, float("inf"), float("-inf"),
          float("nan"), [], {}, [0], [1, 2, 3], [-1], {"a": 1}, [[0]], [None])


_DEEP = "\x00deep:"
"""A string that :func:`_dumps` replaces by that many nested lists (json.dumps itself would recurse)."""


_DEEP_RE = re.compile(re.escape(json.dumps(_DEEP)[:-1]) + r'(\d{1,6})"')


def _deep(depth: int) -> str:
    return f"{_DEEP}{depth}"


def _slots(obj: Any, out: list, depth: int = 0) -> list:
    """Every (container, key) whose value a mutation may replace, depth first."""
    if depth > 64:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            _slots(v, out, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            _slots(v, out, depth + 1)
    return out


def _nasty(rng: random.Random, old: Any, pool: list) -> Any:
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.45:
        return rng.choice((old + 1, old - 1, -old, old * 2, old + 256, old + 4096, old << 20, old // 2,
                           old + (1 << 40) + 8, rng.choice(_INTS)))
    if isinstance(old, str) and r < 0.3:
        return rng.choice((old + "x", old[:-1], old.upper(), old * 2, old[::-1], ""))
    if isinstance(old, list) and r < 0.3 and old:
        return rng.choice((old[:-1], old + old[-1:], old[::-1], [old[0]] * 9, old + [rng.choice(_INTS)]))
    if r < 0.6:
        return rng.choice(_INTS)
    if r < 0.85:
        return copy.deepcopy(rng.choice(_ATOMS))
    if r < 0.93 and pool:
        return copy.deepcopy(_pick(rng, pool))
    return _deep(rng.choice((2, 30, 200, 5000, 100_000)))


def _pick(rng: random.Random, pool: list) -> Any:
    container, key = rng.choice(pool)
    try:
        return container[key]
    except (KeyError, IndexError):  # removed by an earlier change of this round
        return None


def mutate_json(obj: Any, rng: random.Random, n_mutations: int) -> Any:
    """``obj`` (changed in place) with ``n_mutations`` structural changes."""
    slots = _slots(obj, [])
    if not slots:
        return rng.choice(_ATOMS + (_deep(100_000),))
    for _ in range(n_mutations):
        container, key = rng.choice(slots)
        if key not in container if isinstance(container, dict) else key >= len(container):
            continue  # removed by an earlier change of this round
        r = rng.random()
        if r < 0.15:  # delete (a field, a list element, a tensor)
            del container[key]
        elif r < 0.22 and isinstance(container, dict):  # rename
            value = container.pop(key)
            container[rng.choice((str(key) + "_", str(key).upper(), "", str(rng.choice(_INTS))))] = value
        elif r < 0.27 and isinstance(container, dict):  # add an unknown field
            container[rng.choice(("extra", "shard", "parts", "nbytes", "stride", "__proto__"))] = rng.choice(_INTS)
        elif r < 0.32:  # copy another value of the document here
            container[key] = copy.deepcopy(_pick(rng, slots))
        else:
            container[key] = _nasty(rng, container[key], slots)
    return obj


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One byte-level change: truncate, flip, insert a non-UTF-8 byte, splice, nest."""
    b = bytearray(data)
    r = rng.random()
    pos = rng.randrange(len(b) + 1)
    if r < 0.2:
        return bytes(b[:pos])
    if r < 0.4 and b:
        b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
    elif r < 0.55:
        b[pos:pos] = rng.choice((b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80", b"\\ud800", b"\"", b",", b"}", b"]"))
    elif r < 0.7 and b:
        a = rng.randrange(len(b))
        b[pos:pos] = b[a:a + rng.randrange(1, 64)]
    elif r < 0.8:
        n = rng.choice((50, 1000, 100_000))
        b[pos:pos] = b"[" * n + b"]" * n
    elif r < 0.9 and b:
        a = rng.randrange(len(b))
        del b[a:a + rng.randrange(1, 64)]
    else:
        b[pos:pos] = str(rng.choice(_INTS)).encode()
    return bytes(b)


def _dumps(obj: Any) -> bytes:
    text = _DEEP_RE.sub(lambda m: "[" * int(m.group(1)) + "0" + "]" * int(m.group(1)), json.dumps(obj))
    return text.encode("utf-8", "surrogatepass")


def mutate_document(seed: bytes, rng: random.Random) -> bytes:
    """A mutation of the JSON document ``seed``: 1-3 structural changes, sometimes also a byte-level one."""
    try:
        obj = json.loads(seed)
    except ValueError:
        return mutate_bytes(seed, rng)
    r = rng.random()
    if r < 0.12:
        return mutate_bytes(seed, rng)
    data = _dumps(mutate_json(obj, rng, rng.choice((1, 1, 2, 3))))
    if r > 0.92:
        data = mutate_bytes(data, rng)
    return data
