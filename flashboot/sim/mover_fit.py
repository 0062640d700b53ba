"""A mover's cost per chunk, fitted from measured rows, and the chain throughput it predicts.

Copying ``total`` bytes in ``n`` chunks costs ``n * per_call_s + total / bandwidth``: a fixed
price per chunk (host issue, launch, synchronisation) and a rate. :func:`fit_chunked` fits both
by least squares to the rows of ``bench movers --chunked`` (one mover and mode, several chunk
sizes); :func:`predict_chain_s` turns a fit into the time of a chunk-pipelined chain, whose hops
share one GPU's memory bandwidth when they run on it (the measured aggregate of copies at once).
"""

from __future__ import annotations

import math
import numbers
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

    def __post_init__(self) -> None:
        # a negative or infinite rate predicts negative or zero times downstream, silently
        if not (math.isfinite(self.gbps) and self.gbps > 0 and math.isfinite(self.per_call_s) and self.per_call_s >= 0):
            raise FlashBootError(f"{self.mover} ({self.mode}): a fit needs a finite rate > 0 and a finite cost per "
                                 f"call >= 0, got {self.gbps!r} GB/s and {self.per_call_s!r} s")

    def seconds(self, total_bytes: float, n_chunks: int) -> float:
        return n_chunks * self.per_call_s + total_bytes / (self.gbps * 1e9)

    def effective_gbps(self, total_bytes: float, chunk_bytes: float) -> float:
        """GB/s of ``total_bytes`` moved in chunks of ``chunk_bytes``."""
        if not chunk_bytes >= 1 or not total_bytes >= 1:  # also NaN; chunk 0 had divided by zero
            raise FlashBootError(f"chunked rate needs positive sizes, got total {total_bytes!r} bytes in chunks of "
                                 f"{chunk_bytes!r}")
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
            counts = sorted({p[0] for p in pts})
            raise FlashBootError(f"fitting {key[0]} ({key[1]}) needs rows at two chunk counts at least, got "
                                 f"{len(pts)} row(s), all at {counts[0]} chunk(s)")
        a = np.array([[p[0], p[1]] for p in pts], dtype=float)  # seconds = n * per_call + bytes * (1 / rate)
        t = np.array([p[2] for p in pts], dtype=float)
        (per_call, inv_rate), *_ = np.linalg.lstsq(a, t, rcond=None)
        if per_call < 0:  # noise: the rate alone explains the rows
            per_call, inv_rate = 0.0, float(np.sum(a[:, 1] * t) / np.sum(a[:, 1] ** 2))
        gbps = 1.0 / inv_rate / 1e9 if inv_rate != 0 else float("inf")
        if not (math.isfinite(gbps) and gbps > 0):
            # more bytes in less time (or no time at all): the rows contradict the model
            raise FlashBootError(f"fitting {key[0]} ({key[1]}) gives a rate of {gbps:,.0f} GB/s, not a positive one: "
                                 f"rows (n_chunks, bytes, gpu_ms) "
                                 f"{[(int(n), int(b), round(sec * 1e3, 6)) for n, b, sec in pts]}")
        fits[key] = MoverFit(key[0], key[1], float(per_call), float(gbps), len(pts))
    return fits


def predict_chain_s(fit: MoverFit, total_bytes: int, chunk_bytes: int, hops: int, *,
                    aggregate_gbps: float | None = None) -> float:
    """Time for ``hops`` chained copies of ``total_bytes`` pipelined in ``chunk_bytes`` chunks.

    The chain advances in steps: in step ``k`` (1 .. n_chunks + hops - 1) the
    ``a_k = min(k, hops, n_chunks, n_chunks + hops - k)`` hops that hold a chunk copy one each,
    at once, so a step costs ``per_call + a_k * chunk / rate(a_k)`` (the hops' per-call costs
    overlap). Hops on links of their own (``aggregate_gbps`` None) each run at the fit's
    bandwidth: ``rate(a) = a * gbps``. Hops on one GPU share its memory bandwidth:
    ``rate(a) = min(a * gbps, aggregate_gbps)``, with the aggregate that copies running at once
    on that GPU were measured to reach (``bench movers --chunked``'s ``concurrent`` rows).
    """
    # NaN passes every `<= 0` test (a NaN aggregate from a report's JSON returned a NaN time), and
    # a fractional hop count (2.5) was priced without a word
    if isinstance(hops, bool) or not isinstance(hops, numbers.Integral) or hops < 1 or not chunk_bytes > 0 or not total_bytes > 0:
        raise FlashBootError(f"a chain needs an int hops >= 1 and positive sizes; got hops={hops!r}, "
                             f"chunk={chunk_bytes!r}, total={total_bytes!r}")
    if aggregate_gbps is not None and not aggregate_gbps > 0:
        raise FlashBootError(f"the aggregate bandwidth must be positive, got {aggregate_gbps!r} GB/s")
    n = -(-total_bytes // chunk_bytes)
    chunk = total_bytes / n  # the mean chunk: the steps move exactly total_bytes per hop
    k = np.arange(1, n + hops)
    active = np.minimum.reduce([k, np.full_like(k, hops), np.full_like(k, n), n + hops - k])
    rate = active * fit.gbps * 1e9
    if aggregate_gbps is not None:
        rate = np.minimum(rate, aggregate_gbps * 1e9)
    return float(np.sum(fit.per_call_s + active * chunk / rate))


CHAIN_MODELS = {"flag kernels": ("flag_kernel", "flag"), "copy engine + stream memops": ("copy_engine", "per_call")}
"""For a chain row of a report without its own ``model``: the mover and mode whose chunked
curve prices its hops (the flag kernels' own rows; the copy engine issues one copy per chunk)."""


def predict_measured_chains(report: Mapping[str, Any], fits: Mapping[tuple[str, str], MoverFit] | None = None
                            ) -> list[dict[str, Any]]:
    """Each measured chain of a ``bench movers --chunked`` report beside the time the model
    predicts for it, with the fit of its hops' curve (``model``: mover and mode) and the
    aggregate of two copies at once on that GPU (``concurrent`` rows, by mover). Where the
    report has no such aggregate (reports before it was measured) the prediction takes the
    fit's bandwidth as the aggregate and ``aggregate`` says so."""
    fits = fit_chunked(report["rows"]) if fits is None else fits
    aggregates = {c["mover"]: c["aggregate_gbps"] for c in report.get("concurrent", [])}
    out = []
    for chain in report.get("chain", []):
        mover, mode = chain.get("model") or CHAIN_MODELS.get(chain["method"], ("", ""))
        fit = fits.get((mover, mode))
        if len(set(chain.get("devices", [0]))) > 1:  # the rows are one GPU's d2d curves
            out.append({"method": chain["method"], "fit": None, "why": "hops across GPUs: the report has no P2P curve"})
            continue
        if fit is None:
            out.append({"method": chain["method"], "fit": None, "why": f"no rows of {mover or '?'} ({mode or '?'})"})
            continue
        hops = int(chain.get("hops", 2))
        aggregate = aggregates.get(mover)
        predicted_s = predict_chain_s(fit, int(chain["nbytes"]), int(chain["chunk_bytes"]), hops,
                                      aggregate_gbps=aggregate if aggregate is not None else fit.gbps)
        measured_s = chain["chain_ms"] / 1e3
        out.append({"method": chain["method"], "fit": fit, "hops": hops, "nbytes": chain["nbytes"],
                    "chunk_bytes": chain["chunk_bytes"], "measured_s": measured_s, "predicted_s": predicted_s,
                    "error": (predicted_s - measured_s) / measured_s,
                    "aggregate": (f"{aggregate:,.0f} GB/s measured ({hops} copies at once)" if aggregate is not None
                                  else "not measured in this report: the fit's bandwidth")})
    return out


__all__ = ["CHAIN_MODELS", "MoverFit", "fit_chunked", "predict_chain_s", "predict_measured_chains"]
