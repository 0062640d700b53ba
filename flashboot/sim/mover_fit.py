"""A mover's cost per chunk, fitted from measured rows, and the chain throughput it predicts.

Copying ``total`` bytes in ``n`` chunks costs ``n * per_call_s + total / bandwidth``: a fixed
price per chunk (host issue, launch, synchronisation) and a rate. :func:`fit_chunked` fits both
by least squares to the rows of ``bench movers --chunked`` (one mover and mode, several chunk
sizes); :func:`predict_chain_s` turns a fit into the time of a chunk-pipelined chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from flashboot.errors import FlashBootError


@dataclass(frozen=True)
class MoverFit:
    """``seconds(total, n) = n * per_call_s + total / (gbps * 1e9)`` for one mover and mode."""

    mover: str
    mode: str
    per_call_s: float
    gbps: float
    points: int

    def seconds(self, total_bytes: float, n_chunks: int) -> float:
        return n_chunks * self.per_call_s + total_bytes / (self.gbps * 1e9)

    def effective_gbps(self, total_bytes: float, chunk_bytes: float) -> float:
        """GB/s of ``total_bytes`` moved in chunks of ``chunk_bytes``."""
        n = -(-int(total_bytes) // int(chunk_bytes))
        return total_bytes / self.seconds(total_bytes, n) / 1e9


def _field(row: Any, name: str) -> Any:
    return row[name] if isinstance(row, Mapping) else getattr(row, name)


def fit_chunked(rows: Iterable[Any]) -> dict[tuple[str, str], MoverFit]:
    """One fit per ``(mover, mode)`` of rows carrying ``mover, mode, n_chunks, gpu_ms`` and the
    bytes (``total_bytes`` or ``chunk_bytes * n_chunks``). Needs two chunk counts per pair
    (FlashBootError otherwise); a negative intercept (noise) is clamped to zero."""
    groups: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in rows:
        total = _field(r, "total_bytes") if (isinstance(r, Mapping) and "total_bytes" in r) else None
        n = int(_field(r, "n_chunks"))
        if total is None:
            total = int(_field(r, "chunk_bytes")) * n
        groups.setdefault((_field(r, "mover"), _field(r, "mode")), []).append((n, float(total),
                                                                               _field(r, "gpu_ms") / 1e3))
    fits = {}
    for key, pts in groups.items():
        if len({p[0] for p in pts}) < 2:
            raise FlashBootError(f"fitting {key[0]} ({key[1]}) needs rows at two chunk counts at least, got {len(pts)}")
        a = np.array([[p[0], p[1]] for p in pts], dtype=float)  # seconds = n * per_call + bytes * (1 / rate)
        t = np.array([p[2] for p in pts], dtype=float)
        (per_call, inv_rate), *_ = np.linalg.lstsq(a, t, rcond=None)
        if per_call < 0:  # noise: the rate alone explains the rows
            per_call, inv_rate = 0.0, float(np.sum(a[:, 1] * t) / np.sum(a[:, 1] ** 2))
        fits[key] = MoverFit(key[0], key[1], float(per_call), float(1.0 / inv_rate / 1e9), len(pts))
    return fits


def predict_chain_s(fit: MoverFit, total_bytes: int, chunk_bytes: int, hops: int, *, shared_memory: bool) -> float:
    """Time for ``hops`` chained copies of ``total_bytes`` pipelined in ``chunk_bytes`` chunks.

    Each chunk crosses the hops one after another; once the pipe is full every hop works on its
    own chunk, so the chain takes ``(n_chunks + hops - 1)`` chunk times. With ``shared_memory``
    (all hops on one GPU) the hops split its memory bandwidth while they overlap, so a chunk time
    is ``per_call + hops * chunk / rate``; on separate links it is ``per_call + chunk / rate``.
    """
    if hops < 1 or chunk_bytes <= 0 or total_bytes <= 0:
        raise FlashBootError(f"a chain needs hops >= 1 and positive sizes; got hops={hops}, chunk={chunk_bytes}, "
                             f"total={total_bytes}")
    n = -(-total_bytes // chunk_bytes)
    share = hops if shared_memory else 1
    chunk_s = fit.per_call_s + share * min(chunk_bytes, total_bytes) / (fit.gbps * 1e9)
    return (n + hops - 1) * chunk_s


__all__ = ["MoverFit", "fit_chunked", "predict_chain_s"]
