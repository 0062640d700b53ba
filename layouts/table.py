"""The binary tensor table: ``tensors.bin`` beside ``metadata.json``, the same table as columns.

``metadata.json`` stays the canonical, readable form. Parsing its tensor table is the one
per-tensor cost of reading an image (json.loads and the checks of 40,000 entries: 130-180 ms on
an H200 host), so pre-pack also writes the table as fixed-width columns that the reader maps
with numpy in about a millisecond. The file is bound to the very bytes of ``metadata.json``: it
records their sha256 and the byte span of the ``"tensors"`` object inside them. The reader
checks the sha256 (and that of its own columns), parses ``metadata.json`` with that span replaced by ``{}`` (everything but the
table: a few kilobytes) and takes the table from the columns, validated in bulk as strictly as
the JSON reader validates it. A table that is missing (an image written before it existed, or
one with fused ``parts``) means the JSON is parsed; one that does not match its metadata, or is
malformed, is refused. ``flashboot verify`` also compares the two tables entry by entry.

Layout (little-endian)::

    b"FBTENS01"  u64 header_nbytes  header (JSON)  zero padding to 8
    int64 offsets[n]  int64 nbytes[n]  int64 shapes[n*d]  int64 strides[n*d]
    int64 split_ends[n]  int64 splits[s*4] (dim, index, count, blocks)
    uint8 dtypes[n]  uint8 regions[n]  uint8 ndims[n]  names (UTF-8, NUL-separated)
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from flashboot.errors import LayoutError

from .format import _ITEMSIZE, DTYPE_NAMES, MAX_IMAGE_NBYTES, REGIONS, DimColumns, TensorTable, _split

TABLE_FILE = "tensors.bin"
MAGIC = b"FBTENS01"
TABLE_FORMAT = "flashboot-tensor-table"
MAX_HEADER_NBYTES = 1 << 16
_I64 = np.dtype("<i8")
T = TypeVar("T")


def tensors_span(metadata_bytes: bytes) -> tuple[int, int]:
    """Byte span of the ``"tensors"`` object's value in ``metadata.json`` as
    :meth:`~flashboot.layouts.format.ImageMetadata.to_json` writes it (the table comes last)."""
    key = b'\n "tensors": '
    start = metadata_bytes.rfind(key)
    end = metadata_bytes.rfind(b"}")  # closes the whole document
    if start < 0 or end <= start:
        raise LayoutError("metadata.json has no trailing \"tensors\" object to index")
    return start + len(key), end


def encode_table(table: TensorTable, metadata_bytes: bytes) -> bytes | None:
    """``tensors.bin`` for ``table`` as written in ``metadata_bytes``; None for a table with fused
    ``parts`` (rare: SGLang's stacked projections) or a NUL in a name, which stay JSON-only."""
    if table._parts or any("\0" in name for name in table.names):
        return None
    n = len(table)
    dims = table.dim_columns()
    ndims, shapes, strides = dims.ndims, dims.shapes, dims.strides
    d = shapes.shape[1]
    names = "\0".join(table.names).encode()
    splits = [table.shard_of(i) for i in range(n)]
    split_ends = np.cumsum(np.fromiter(map(len, splits), np.int64, n)) if n else np.zeros(0, np.int64)
    split_rows = np.array([(s.dim, s.index, s.count, s.blocks) for row in splits for s in row], _I64).reshape(-1, 4)
    start, end = tensors_span(metadata_bytes)
    columns = [np.ascontiguousarray(a, _I64).tobytes() for a in (table.offsets, table.nbytes, shapes, strides,
                                                                split_ends, split_rows)]
    columns += [np.ascontiguousarray(a, np.uint8).tobytes() for a in (table.dtype_codes, table.region_codes, ndims)]
    columns.append(names)
    body = b"".join(columns)
    header = json.dumps({"format": TABLE_FORMAT, "version": 1, "count": n, "ndim": d, "splits": len(split_rows),
                         "names_nbytes": len(names),
                         "metadata_sha256": hashlib.sha256(metadata_bytes).hexdigest(),
                         "body_sha256": hashlib.sha256(body).hexdigest(),
                         "tensors_span": [start, end]}).encode()
    pad = -(len(MAGIC) + 8 + len(header)) % 8
    return b"".join([MAGIC, struct.pack("<Q", len(header) + pad), header, b" " * pad, body])


@dataclass(frozen=True)
class DecodedTable:
    """``tensors.bin`` decoded before the ``metadata.json`` it binds is read (:func:`predecode_table`):
    its header and table, or the error to raise. ``header_error`` comes before the metadata's
    sha256 is compared, ``error`` after, the order in which :func:`decode_table` names them."""

    header: dict | None
    table: TensorTable | None
    span: tuple[int, int] | None
    header_error: Exception | None = None
    error: Exception | None = None


def predecode_table(data: bytes, where: str, metadata_nbytes: int, *, beside: bool = True) -> DecodedTable:
    """Everything :func:`decode_table` checks of ``data`` but the sha256 of the metadata it binds,
    given only that metadata's size: the columns (names, bounds, the body's sha256) can then be
    decoded while ``metadata.json`` is still being read and hashed (both release the GIL).
    ``beside``: the body hashed in a thread while the columns are decoded (:func:`sha256_beside`);
    False: hashed in this thread, after. Raises nothing: the errors are kept for
    :func:`decode_table` to raise in its order."""
    try:
        h, body = _header(data, where)
    except LayoutError as exc:
        return DecodedTable(None, None, None, header_error=exc)
    try:
        table, span = _body(data, h, body, where, metadata_nbytes, beside)
    except Exception as exc:  # noqa: BLE001 - raised by decode_table after the sha256 comparison
        return DecodedTable(h, None, None, error=exc)
    return DecodedTable(h, table, span)


def decode_table(data: bytes, metadata_bytes: bytes, where: str, metadata_sha256: str | None = None,
                 decoded: DecodedTable | None = None) -> tuple[TensorTable, tuple[int, int]]:
    """Validate ``tensors.bin`` (``data``) against ``metadata.json``'s bytes; returns the table and
    the byte span of the JSON table it stands for. LayoutError naming ``where`` and the field.
    ``metadata_sha256``: the bytes' hex sha256 where the caller has it already (not hashed again);
    ``decoded``: :func:`predecode_table` of ``data`` made before the metadata bytes were read."""
    if decoded is None:
        decoded = predecode_table(data, where, len(metadata_bytes))
    if decoded.header_error is not None:
        raise decoded.header_error
    h = decoded.header
    sha = metadata_sha256 or hashlib.sha256(metadata_bytes).hexdigest()
    if h["metadata_sha256"] != sha:
        raise LayoutError(f"{where}: written for a metadata.json of sha256 {h['metadata_sha256'][:16]}, the one beside "
                          f"it has {sha[:16]}: the table or the metadata was changed after pre-pack")
    if decoded.error is not None:
        raise decoded.error
    span = decoded.span
    if span[1] > len(metadata_bytes):  # the size the pre-decode was given was not the size read
        raise LayoutError(f"{where}: tensors_span {list(span)!r} is not inside the {len(metadata_bytes):,}-byte metadata")
    return decoded.table, span


def _header(data: bytes, where: str) -> tuple[dict, int]:
    """The header of ``tensors.bin`` checked field by field, and where its body starts."""
    if len(data) < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        raise LayoutError(f"{where}: not a {TABLE_FORMAT} file (magic {data[:len(MAGIC)]!r})")
    (hlen,) = struct.unpack_from("<Q", data, len(MAGIC))
    body = len(MAGIC) + 8 + hlen
    if hlen > MAX_HEADER_NBYTES or body > len(data):
        raise LayoutError(f"{where}: header of {hlen:,} bytes in a {len(data):,}-byte file")
    try:
        h = json.loads(data[len(MAGIC) + 8:body])
    except (ValueError, UnicodeDecodeError) as exc:
        raise LayoutError(f"{where}: header is not JSON ({exc})") from None
    fields = {"format": str, "version": int, "count": int, "ndim": int, "splits": int, "names_nbytes": int,
              "metadata_sha256": str, "body_sha256": str, "tensors_span": list}
    if not isinstance(h, dict):
        raise LayoutError(f"{where}: header must be an object")
    for key, kind in fields.items():
        if type(h.get(key)) is not kind:
            raise LayoutError(f"{where}: header field {key!r} must be {kind.__name__}, found {h.get(key)!r}")
    if h["format"] != TABLE_FORMAT or h["version"] != 1:
        raise LayoutError(f"{where}: {h['format']!r} version {h['version']}; this flashboot reads {TABLE_FORMAT} 1")
    return h, body


def _body(data: bytes, h: dict, body: int, where: str, metadata_nbytes: int, beside: bool = True
          ) -> tuple[TensorTable, tuple[int, int]]:
    """The columns after the header ``h``: counts, the table's span in a metadata of
    ``metadata_nbytes`` bytes, the file's size, the body's sha256, then the columns themselves."""
    n, d, s, names_nbytes = h["count"], h["ndim"], h["splits"], h["names_nbytes"]
    span = h["tensors_span"]
    if min(n, d, s, names_nbytes) < 0 or d > 64:
        raise LayoutError(f"{where}: header counts out of range (count {n}, ndim {d}, splits {s}, names "
                          f"{names_nbytes})")
    if len(span) != 2 or not all(type(x) is int for x in span) or not 0 <= span[0] < span[1] <= metadata_nbytes:
        raise LayoutError(f"{where}: tensors_span {span!r} is not inside the {metadata_nbytes:,}-byte metadata")
    expected = body + 8 * (2 * n + 2 * n * d + n + 4 * s) + 3 * n + names_nbytes
    if len(data) != expected:
        raise LayoutError(f"{where}: {len(data):,} bytes, the header implies {expected:,}")
    columns = memoryview(data)[body:]
    body_digest = sha256_beside(columns) if beside else lambda: hashlib.sha256(columns).hexdigest()
    try:
        table = _columns(data, body, n, d, s, names_nbytes, where)
        column_error = None
    except Exception as exc:  # raised once the hash says the columns are the ones written
        table, column_error = None, exc
    found = body_digest()
    if found != h["body_sha256"]:  # named first: a damaged file, whatever its columns say
        raise LayoutError(f"{where}: columns of sha256 {found[:16]}, the header records {h['body_sha256'][:16]} "
                          "(damaged file)") from None
    if column_error is not None:
        raise column_error
    return table, (span[0], span[1])


THREAD_HASH_NBYTES = 1 << 20
"""From this size on, :func:`sha256_beside` hashes in a thread (starting one costs ~0.1 ms)."""
HASH_TIMEOUT_S = 120.0
"""How long the waiter waits for such a hash (~2 GB/s: a 100 MB table takes 50 ms)."""


def sha256_beside(data) -> Callable[[], str]:
    """Start hashing ``data`` (bytes-like) in a thread; returns the call that waits for its hex
    sha256. hashlib releases the GIL over large buffers, so the caller's own work (the names and
    column checks, 10-20 ms for 40,000 tensors) runs beside the hash instead of after it (2.7 ms
    for the 4 MB of such a table). Below :data:`THREAD_HASH_NBYTES`, hashed at once."""
    if len(data) < THREAD_HASH_NBYTES:
        digest = hashlib.sha256(data).hexdigest()
        return lambda: digest
    return run_beside(lambda: hashlib.sha256(data).hexdigest(), f"hashing {len(data):,} bytes")


def run_beside(work: Callable[[], T], what: str) -> Callable[[], T]:
    """Start ``work()`` in a daemon thread (work that releases the GIL: file reads, hashing);
    returns the call that waits for its result (at most :data:`HASH_TIMEOUT_S`, then LayoutError
    saying ``what`` took too long) and raises what it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # handed to the waiter
            out.append(exc)

    thread = threading.Thread(target=run, name="flashboot-beside", daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # "can't start new thread": Python's words name no limit
        from flashboot.memory import thread_refused

        raise thread_refused(what, exc) from None

    def result() -> T:
        thread.join(HASH_TIMEOUT_S)
        if not out:
            raise LayoutError(f"{what} took over {HASH_TIMEOUT_S:g} s")
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return result


def _columns(data: bytes, body: int, n: int, d: int, s: int, names_nbytes: int, where: str) -> TensorTable:
    """The table held by the columns of ``data`` from ``body`` on, checked (:func:`_check_columns`)."""
    at = body

    def take(count: int, dtype) -> np.ndarray:
        nonlocal at
        a = np.frombuffer(data, dtype, count, at)
        at += a.nbytes
        return a

    offsets, nbytes = take(n, _I64), take(n, _I64)
    shapes, strides = take(n * d, _I64).reshape(n, d), take(n * d, _I64).reshape(n, d)
    split_ends = take(n, _I64)
    split_rows = take(4 * s, _I64).reshape(s, 4)
    dtypes, regions, ndims = take(n, np.uint8), take(n, np.uint8), take(n, np.uint8)
    names_blob = data[at:at + names_nbytes]
    names = _names(names_blob, n, where)
    _check_columns(names, offsets, nbytes, shapes, strides, ndims, dtypes, regions, split_ends, split_rows, where)
    shards = None
    if s:
        starts = np.concatenate(([0], split_ends[:-1])).tolist()
        rows = split_rows.tolist()
        shards = [tuple(_split(*rows[k]) for k in range(a, b)) or None for a, b in zip(starts, split_ends.tolist())]
    # The columns stay views of ``data`` (immutable bytes); shape and stride tuples are built only if asked for.
    return TensorTable(names, offsets, nbytes, dtypes, regions, DimColumns(ndims, shapes, strides), None, shards)


def _names(blob: bytes, n: int, where: str) -> list[str]:
    try:
        names = blob.decode().split("\0") if n else []
    except UnicodeDecodeError as exc:
        raise LayoutError(f"{where}: tensor names are not UTF-8 ({exc})") from None
    if len(names) != n or "" in names:  # a list's "in" compares lengths first: ~3x faster than a search of the blob
        raise LayoutError(f"{where}: the name blob holds {len(names)} names (or an empty one) for {n} tensors")
    if len(set(names)) != n:
        seen: set[str] = set()
        dup = next(x for x in names if x in seen or seen.add(x))
        raise LayoutError(f"{where}: tensor {dup!r} appears twice")
    return names


def _check_columns(names, offsets, nbytes, shapes, strides, ndims, dtypes, regions, split_ends, split_rows,
                   where: str) -> None:
    """What :meth:`TensorTable.from_json` checks of each entry, on the columns at once."""
    def first(mask) -> int | None:
        idx = np.flatnonzero(mask)
        return int(idx[0]) if len(idx) else None

    n, d = shapes.shape
    for label, mask in (("dtype", dtypes >= len(DTYPE_NAMES)), ("region", regions >= len(REGIONS)),
                        ("ndim", ndims > d), ("offset", offsets < 0)):
        bad = first(mask)
        if bad is not None:
            raise LayoutError(f"{where}: tensor {names[bad]!r} has an invalid {label}")
    # one column at a time: numpy reduces short rows slowly (any(axis=1) over 40,000 rows of 2
    # took ~0.8 ms; a column is a pass at memory speed)
    bad_dims = np.zeros(n, bool)
    for k in range(d):
        either = shapes[:, k] | strides[:, k]  # negative where either is; zero where both are
        bad_dims |= (either < 0) | ((either != 0) & (ndims <= k))
    bad = first(bad_dims)
    if bad is not None:
        raise LayoutError(f"{where}: tensor {names[bad]!r}: shape {shapes[bad].tolist()} / stride "
                          f"{strides[bad].tolist()} must be ints >= 0 within its {int(ndims[bad])} dims")
    span, estimate = _padded_spans(shapes, strides, ndims, _ITEMSIZE[dtypes])
    bad = first((estimate > MAX_IMAGE_NBYTES) | (span != nbytes))
    if bad is not None:
        raise LayoutError(f"{where}: tensor {names[bad]!r} records nbytes {int(nbytes[bad]):,} but shape "
                          f"{shapes[bad][:ndims[bad]].tolist()}, stride {strides[bad][:ndims[bad]].tolist()} and "
                          f"{DTYPE_NAMES[int(dtypes[bad])]} span {float(estimate[bad]):,.0f} bytes")
    if len(split_ends):
        counts = np.diff(split_ends, prepend=0)
        if (counts < 0).any() or split_ends[-1] != len(split_rows):
            raise LayoutError(f"{where}: shard offsets do not tile the {len(split_rows)} splits")
        owner = np.repeat(np.arange(n), counts)
        dim, index, count, blocks = split_rows.T if len(split_rows) else (np.zeros(0, np.int64),) * 4
        bad = first((dim < 0) | (dim >= ndims[owner]) | (index < 0) | (count < 1) | (index >= count) | (blocks < 1))
        if bad is not None:
            raise LayoutError(f"{where}: tensor {names[int(owner[bad])]!r}: invalid shard "
                              f"{split_rows[bad].tolist()} (dim, index, count, blocks)")


def _padded_spans(shapes: np.ndarray, strides: np.ndarray, ndims: np.ndarray, itemsize: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~flashboot.layouts.tensor_table._spans` of the ``(n, d)`` columns, whose dims beyond
    each tensor's ``ndim`` are 0 in both (checked before): there ``(0 - 1) * 0`` adds nothing, so
    the sums run over whole rows without flattening, a column at a time."""
    n, d = shapes.shape
    elems = np.ones(n, np.int64)  # may wrap for absurd values: the float estimate catches them
    estimate = np.ones(n)
    empty = np.zeros(n, bool)
    for k in range(d):
        shape, stride = shapes[:, k], strides[:, k]
        elems += (shape - 1) * stride
        estimate += (shape - 1.0) * stride
        empty |= (shape == 0) & (ndims > k)
    nbytes = elems * itemsize
    estimate *= itemsize
    nbytes[empty] = 0
    estimate[empty] = 0.0
    return nbytes, estimate


def tables_agree(a: TensorTable, b: TensorTable) -> str | None:
    """None when the two tables hold the same entries in the same order, else the first difference."""
    if a.names != b.names:
        k = next((i for i, (x, y) in enumerate(zip(a.names, b.names)) if x != y), min(len(a), len(b)))
        return f"names differ at entry {k} ({len(a)} vs {len(b)} tensors)"
    for label, x, y in (("offset", a.offsets, b.offsets), ("nbytes", a.nbytes, b.nbytes),
                        ("dtype", a.dtype_codes, b.dtype_codes), ("region", a.region_codes, b.region_codes)):
        if not np.array_equal(x, y):
            return f"{label} of {a.names[int(np.flatnonzero(x != y)[0])]!r} differs"
    for i, name in enumerate(a.names):
        if a.shapes[i] != b.shapes[i] or a.strides[i] != b.strides[i] or a.shard_of(i) != b.shard_of(i):
            return f"shape, stride or shard of {name!r} differs"
    return None


__all__ = ["TABLE_FILE", "DecodedTable", "decode_table", "encode_table", "predecode_table", "run_beside", "tables_agree",
           "tensors_span"]
