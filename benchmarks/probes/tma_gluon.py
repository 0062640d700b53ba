"""Probe: does a Gluon TMA copy (global -> shared -> global, no registers) reach 0.90x the copy engine?

The repo's TMA copies are plain Triton: ``desc.load`` brings a box into shared memory, then into
registers, back into shared memory, and ``desc.store`` sends it out, waiting on the store before
the buffer is reused. They reach 0.889-0.894x the copy engine for 1 GiB as a batch of 4 MiB
chunks. Gluon (``triton.experimental.gluon``, the Triton 3.6.0 API) lets the kernel drive TMA
itself: each program keeps a ring of ``STAGES`` shared-memory boxes; a box is filled by
``tma.async_copy_global_to_shared`` (completion signalled on its mbarrier) and written out by
``tma.async_copy_shared_to_global`` straight from the same box. The only waits are the box's
mbarrier before its store and ``tma.store_wait(PENDING)`` (the shared-memory read of all but the
newest ``PENDING`` stores) before a box is refilled, so ``STAGES - PENDING`` loads stay in flight.

Both copies view the bytes as rows of 128 B (16 int64, the widest swizzle span) and move boxes of
``ROWS`` x 128 B through descriptors made on the host over the whole buffers:

- :func:`gluon_copy`: one copy of N bytes, a persistent grid striding over the boxes;
- :class:`GluonBatch`: a list of ``(dst_offset, src_offset, nbytes)`` chunks between two ranges
  (two arenas) in one launch. A small int64 table on the device holds ``[dst_row, src_row,
  n_rows, first_tile]`` per chunk (128-B row units, tile prefix sums); program ``p`` of ``P``
  copies the tiles ``[p*T//P, (p+1)*T//P)`` and walks the table from the row the host found for
  it, so no program searches. Offsets and sizes must be multiples of the box (ROWS x 128 B):
  anything else raises ValueError naming the chunk.

Run on the GPU (from the repo root): ``python3 benchmarks/probes/tma_gluon.py``. For 1 GiB on
cuda:0 it times, median of 5 CUDA-event samples after 2 warm-ups, each behind a ~5 ms spin
kernel (benchmarks/RESULTS.md's convention, :func:`flashboot.benchmarks.timing.time_cuda`): the
copy-engine ceiling (``dst.copy_(src)``), the single copy, the batch of 4 MiB and of 1 MiB chunks,
over rows per box x stages x programs per SM x warps; then, for each case's best, the extras
(a proxy fence before each store, other store lags, no swizzle, chunks in shuffled order, the
single copy as contiguous runs per program through the batch kernel). Every
variant is checked byte-exact and printed as one JSON line (``ratio`` = ceiling ms / ms); the
last line is a summary of the best variant per case.

Without a GPU: ``python3 benchmarks/probes/tma_gluon.py --compile-only`` compiles both kernels for
sm_90a and checks the PTX: bulk tensor loads and stores, and no ``ld.shared``/``st.shared``
(the data never passes through registers).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time

import numpy as np
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashboot.kernels.tma_ring_kernel import copy_ring_kernel

ROW_BYTES = 128
"""Bytes per descriptor row: 16 int64, the 128-byte swizzle span."""
COLS = ROW_BYTES // 8
SMEM_PER_SM = 228 * 1024
"""Hopper's shared memory per SM; a block also reserves 1 KiB. Programs per SM that do not fit
would run in a second wave, so the sweep skips them."""


@gluon.jit
def copy_kernel(src_desc, dst_desc, n_tiles, STAGES: gl.constexpr, PENDING: gl.constexpr, FENCE: gl.constexpr):
    """Copy boxes ``pid, pid + nprog, ...`` of ``src_desc`` to the same boxes of ``dst_desc``."""
    ROWS: gl.constexpr = src_desc.block_type.shape[0]
    NBYTES: gl.constexpr = src_desc.block_type.nbytes
    LEAD: gl.constexpr = STAGES - PENDING  # loads in flight ahead of the store being issued
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_mine = (n_tiles - pid + nprog - 1) // nprog
    bufs = gl.allocate_shared_memory(src_desc.dtype, [STAGES, ROWS, src_desc.block_type.shape[1]], src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):  # (a static_range's name must not be reused by a range() loop)
        mbarrier.init(bars.index(k), count=1)

    for q in gl.static_range(LEAD):  # prologue: fill the first LEAD boxes
        live = q < n_mine
        mbarrier.expect(bars.index(q), NBYTES, pred=live)
        tma.async_copy_global_to_shared(src_desc, [(pid + q * nprog) * ROWS, 0], bars.index(q), bufs.index(q),
                                        pred=live)

    for i in range(n_mine):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        if FENCE:  # order the TMA load's shared-memory writes before the TMA store's reads
            fence_async_shared()
        tma.async_copy_shared_to_global(dst_desc, [(pid + i * nprog) * ROWS, 0], bufs.index(s))
        # the box of tile j = i + LEAD is the box of tile i - PENDING: free once all but the
        # newest PENDING stores have read shared memory
        tma.store_wait(PENDING)
        j = i + LEAD
        live = j < n_mine
        r = j % STAGES
        mbarrier.expect(bars.index(r), NBYTES, pred=live)
        tma.async_copy_global_to_shared(src_desc, [(pid + j * nprog) * ROWS, 0], bars.index(r), bufs.index(r),
                                        pred=live)

    tma.store_wait(0)  # the boxes must stay until the last store has read them
    for k in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(k))


def smem_layout(swizzle: int = 128) -> gl.NVMMASharedLayout:
    """The boxes' shared-memory layout; load and store use the same one, so any swizzle is exact."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=64, rank=2)


def smem_bytes(rows: int, stages: int) -> int:
    """A program's shared memory: its boxes and their mbarriers."""
    return stages * rows * ROW_BYTES + stages * 8


def _rows_view(t, what: str):
    """``t`` (a contiguous CUDA tensor) as int64 rows of 128 B: ValueError unless it is 16-byte
    aligned (TMA's rule for a base address), a whole number of rows, and fewer than 2**31 rows
    (the descriptor's shape and the box coordinates are int32: 256 GiB)."""
    import torch

    nbytes = t.numel() * t.element_size()
    if t.data_ptr() % 16 or nbytes % ROW_BYTES or nbytes // ROW_BYTES >= 1 << 31 or not t.is_contiguous():
        raise ValueError(f"{what}: TMA copy needs a contiguous, 16-byte aligned buffer of a multiple of {ROW_BYTES} B "
                         f"below 256 GiB; got address {t.data_ptr():#x}, {nbytes:,} B")
    return t.view(-1).view(torch.int64).view(-1, COLS)


def _descriptors(dst2d, src2d, rows: int, swizzle: int):
    layout = smem_layout(swizzle)
    mk = lambda t: TensorDescriptor(t, list(t.shape), [COLS, 1], [rows, COLS], layout)  # noqa: E731
    return mk(src2d), mk(dst2d)


def gluon_copy(dst, src, *, rows: int = 256, stages: int = 4, programs: int, num_warps: int = 1, pending: int = 1,
               fence: bool = False, swizzle: int = 128) -> None:
    """Copy all of ``src`` into ``dst`` (same size) on the current stream, in one launch."""
    if dst.numel() * dst.element_size() != src.numel() * src.element_size():
        raise ValueError("gluon_copy: dst and src differ in size")
    src2d, dst2d = _rows_view(src, "src"), _rows_view(dst, "dst")
    n_tiles = -(-src2d.shape[0] // rows)  # a last partial box is zero-filled on load and clipped on store
    src_desc, dst_desc = _descriptors(dst2d, src2d, rows, swizzle)
    copy_kernel[(max(1, min(programs, n_tiles)),)](src_desc, dst_desc, n_tiles, STAGES=stages, PENDING=pending,
                                                   FENCE=fence, num_warps=num_warps)


def batch_table(chunks, *, rows: int, dst_bytes: int, src_bytes: int, programs: int):
    """The batch kernel's table and each program's first row, as numpy int64 arrays.

    ``table`` has one row ``[dst_row, src_row, n_rows, first_tile]`` per non-empty chunk (in
    128-B rows; ``first_tile``: the prefix sum of the chunks' tiles, in the given order) and a
    sentinel ``[0, 0, 0, n_tiles]``; ``starts[p]`` is the row holding tile ``p * n_tiles // P``.
    ValueError names the first chunk that is not a whole number of boxes inside its ranges."""
    box = rows * ROW_BYTES
    entries = []
    for k, (d, s, n) in enumerate(chunks):
        d, s, n = int(d), int(s), int(n)
        if n == 0:  # nothing to copy; the kernel's cursors assume every row has a tile
            continue
        if d % box or s % box or n % box or min(d, s, n) < 0 or d + n > dst_bytes or s + n > src_bytes:
            raise ValueError(f"chunk {k} (dst_offset {d:,}, src_offset {s:,}, nbytes {n:,}) is not a whole number of "
                             f"{box:,}-byte boxes inside the ranges (dst {dst_bytes:,} B, src {src_bytes:,} B)")
        entries.append((d // ROW_BYTES, s // ROW_BYTES, n // ROW_BYTES))
    if not entries:
        raise ValueError("batch_table: no bytes to copy")
    table = np.zeros((len(entries) + 1, 4), dtype=np.int64)
    table[:-1, :3] = entries
    table[1:, 3] = np.cumsum(table[:-1, 2] // rows)
    n_tiles = int(table[-1, 3])
    programs = max(1, min(programs, n_tiles))
    p = np.arange(programs, dtype=np.int64)
    starts = (np.searchsorted(table[:-1, 3], p * n_tiles // programs, side="right") - 1).astype(np.int64)
    return table, starts


class GluonBatch:
    """A prepared batch: chunks ``(dst_offset, src_offset, nbytes)`` from range ``src`` into range
    ``dst`` (CUDA tensors), copied by :meth:`launch` in one kernel on the current stream.

    Every offset and size must be a multiple of the box (``rows`` x 128 B) and lie inside its
    range; ValueError names the first chunk that does not. Empty chunks are dropped."""

    def __init__(self, dst, src, chunks, *, rows: int, programs: int):
        import torch

        self.src2d, self.dst2d = _rows_view(src, "src range"), _rows_view(dst, "dst range")
        table, starts = batch_table(chunks, rows=rows, dst_bytes=self.dst2d.numel() * 8,
                                    src_bytes=self.src2d.numel() * 8, programs=programs)
        self.rows, self.n_tiles, self.programs = rows, int(table[-1, 3]), len(starts)
        self.table = torch.from_numpy(table.ravel().copy()).to(src.device)
        self.starts = torch.from_numpy(starts).to(src.device)

    def launch(self, *, stages: int, num_warps: int = 1, pending: int = 1, fence: bool = False,
               swizzle: int = 128) -> None:
        # the mover's kernel (flashboot.kernels.tma_ring_kernel): one store in flight, no fence; the
        # 2026-12-02 run of this probe's own copy of it measured the others no faster (fence 0.908x,
        # store lag 0 0.909x, lag 2 0.903x, against 0.912x at 4 MiB)
        if pending != 1 or fence:
            raise ValueError("the batch kernel keeps one store in flight and no fence")
        src_desc, dst_desc = _descriptors(self.dst2d, self.src2d, self.rows, swizzle)
        copy_ring_kernel[(self.programs,)](src_desc, dst_desc, self.table, self.starts, self.n_tiles, STAGES=stages,
                                           num_warps=num_warps)


# --- without a GPU: compile for sm_90a and read the PTX -------------------------------------------


def _desc_sig(rows: int, swizzle: int = 128) -> str:
    return f"tensordesc<i64[{rows}, {COLS}],{smem_layout(swizzle)!r}>"


def compile_only() -> int:
    """Compile both kernels for sm_90a (no GPU needed: Triton ships ptxas) and check the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    failed = 0
    cases = [(copy_kernel, {"n_tiles": "i32"}), (copy_ring_kernel, {"table_ptr": "*i64", "starts_ptr": "*i64",
                                                                    "n_tiles": "i64"})]
    for fn, extra in cases:
        for rows, stages, pending, warps, fence, swizzle in ((256, 4, 1, 1, False, 128), (128, 6, 2, 4, False, 128),
                                                             (256, 3, 1, 1, True, 128), (256, 2, 0, 1, False, 0)):
            if fn is copy_ring_kernel and (pending != 1 or fence):
                continue  # the mover's kernel has neither knob
            knobs = {"PENDING": pending, "FENCE": fence} if fn is copy_kernel else {}
            sig = {"src_desc": _desc_sig(rows, swizzle), "dst_desc": _desc_sig(rows, swizzle), **extra,
                   "STAGES": "constexpr", **{k: "constexpr" for k in knobs}}
            consts = {"STAGES": stages, **knobs}
            cfg = {"kernel": fn.__name__, "rows": rows, "stages": stages, "pending": pending, "warps": warps,
                   "fence": fence, "swizzle": swizzle}
            try:
                k = triton.compile(GluonASTSource(fn, sig, consts), target=target, options={"num_warps": warps})
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(json.dumps({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}), flush=True)
                failed += 1
                continue
            ptx = k.asm["ptx"]
            loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx))
            stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx))
            reg_path = len(re.findall(r"\b(?:ld|st)\.shared\.", ptx))  # data through registers
            ok = loads > 0 and stores > 0 and reg_path == 0 and "cubin" in k.asm
            failed += not ok
            print(json.dumps({**cfg, "ok": ok, "target": re.search(r"\.target (\S+)", ptx).group(1),
                              "ptx_tma_loads": loads, "ptx_tma_stores": stores, "ptx_ld_st_shared": reg_path,
                              "ptx_store_waits": len(re.findall(r"cp\.async\.bulk\.wait_group\.read", ptx)),
                              "ptx_fences": len(re.findall(r"fence\.proxy\.async", ptx)),
                              "ptx_bar_sync": len(re.findall(r"\bbar\.sync|barrier\.sync", ptx)),
                              "shared_bytes": k.metadata.shared, "cubin_bytes": len(k.asm["cubin"])}), flush=True)
    return 1 if failed else 0


# --- on the GPU ------------------------------------------------------------------------------------


def main() -> None:
    import torch

    from flashboot.benchmarks.timing import time_cuda

    t_start = time.monotonic()
    budget_s = 45.0  # the sweep stops here, leaving ~10 s for the extras and the summary (total ~60 s)
    n = 1 << 30
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros_like(a)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def measure(fn) -> float:
        def on(stream):
            with torch.cuda.stream(stream):
                fn()
        return time_cuda(on, device=0, warmup=2, repeats=5).median_ms

    ceiling = measure(lambda: b.copy_(a))
    print(json.dumps({"what": "ceiling (copy_)", "ms": round(ceiling, 4), "gbps": round(n / ceiling / 1e6, 1),
                      "sms": sms}), flush=True)
    best: dict[str, dict] = {}

    def run(case: str, make, cfg: dict) -> None:
        """Time ``make(cfg)``'s launch and print its line; a failure to prepare, compile or launch
        prints an error line instead."""
        b.zero_()
        torch.cuda.synchronize()  # time_cuda runs on its own stream: the zeroing must be done first
        try:
            ms = measure(make(cfg))
        except Exception as exc:  # noqa: BLE001 - a probe reports what failed and goes on
            torch.cuda.synchronize()
            print(json.dumps({"what": case, **cfg, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
            return
        ok = bool(torch.equal(a, b))
        row = {"what": case, **cfg, "ms": round(ms, 4), "gbps": round(n / ms / 1e6, 1),
               "ratio": round(ceiling / ms, 4), "bit_exact": ok}
        print(json.dumps(row), flush=True)
        if ok and (case not in best or ms < best[case]["ms"]):
            best[case] = row

    def chunks_of(size: int, shuffled: bool = False):
        out = [(o, o, size) for o in range(0, n, size)]
        if shuffled:  # same places, other order: a table whose neighbouring rows are far apart
            random.Random(0).shuffle(out)
        return out

    batches: dict[tuple, GluonBatch] = {}

    def batch(size: int, rows: int, programs: int, shuffled: bool = False) -> GluonBatch:
        key = (size, rows, programs, shuffled)
        if key not in batches:
            batches[key] = GluonBatch(b, a, chunks_of(size, shuffled), rows=rows, programs=programs)
        return batches[key]

    def batched(size: int):
        def make(c):
            bt = batch(size, c["rows"], sms * c["per_sm"], c.get("shuffled", False))
            return lambda: bt.launch(stages=c["stages"], num_warps=c["warps"], pending=c["pending"], fence=c["fence"],
                                     swizzle=c["swizzle"])
        return make

    cases = {
        "gluon single": lambda c: (lambda: gluon_copy(b, a, rows=c["rows"], stages=c["stages"],
                                                      programs=sms * c["per_sm"], num_warps=c["warps"],
                                                      pending=c["pending"], fence=c["fence"], swizzle=c["swizzle"])),
        "gluon batch 4 MiB": batched(4 << 20),
        "gluon batch 1 MiB": batched(1 << 20),
        # the single copy as contiguous runs of tiles per program (the batch kernel, one chunk):
        # an extra on the single copy's best, not swept
        "gluon single as 1-chunk batch": batched(n),
    }
    swept = ("gluon single", "gluon batch 4 MiB", "gluon batch 1 MiB")

    sweep = [dict(rows=r, stages=s, per_sm=p, warps=w, pending=1, fence=False, swizzle=128)
             for r in (256, 128) for s in (4, 3, 6, 2) for p in (1, 2) for w in (1, 4)]
    for cfg in sweep:
        if cfg["per_sm"] * (smem_bytes(cfg["rows"], cfg["stages"]) + 1024) > SMEM_PER_SM:
            print(json.dumps({"what": "skip", **cfg, "why": "programs per SM do not fit in shared memory"}))
            continue
        if time.monotonic() - t_start > budget_s:
            print(json.dumps({"what": "skip", **cfg, "why": f"past the {budget_s:.0f} s budget"}))
            continue
        for case in swept:
            run(case, cases[case], cfg)

    # extras on each case's best: the cost of a proxy fence, other store lags, no swizzle, shuffled chunks
    for case in list(best):
        top = {k: v for k, v in best[case].items() if k in sweep[0]}
        extras = [dict(top, swizzle=0)]
        if case.startswith("gluon batch"):  # the mover's kernel: no store-lag or fence knobs
            extras.append(dict(top, shuffled=True))
        else:
            extras += [dict(top, fence=True), dict(top, pending=0)] + ([dict(top, pending=2)] if top["stages"] > 2 else [])
        for cfg in extras:
            run(case + (" shuffled" if cfg.get("shuffled") else ""), cases[case], cfg)
        if case == "gluon single":
            run("gluon single as 1-chunk batch", cases["gluon single as 1-chunk batch"], top)

    end = measure(lambda: b.copy_(a))
    print(json.dumps({"what": "ceiling again", "ms": round(end, 4), "gbps": round(n / end / 1e6, 1)}), flush=True)
    print(json.dumps({"what": "summary", "ceiling_ms": round(ceiling, 4), "ceiling_again_ms": round(end, 4),
                      "seconds": round(time.monotonic() - t_start, 1),
                      "best": {case: dict(row, ratio_vs_ceiling_again=round(end / row["ms"], 4))
                               for case, row in best.items()}}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a and check the PTX (no GPU)")
    if parser.parse_args().compile_only:
        sys.exit(compile_only())
    main()
