"""Probe: does a TMA copy move more per second with one 2-D box per tile than with 1-D boxes?

Run 1 (2026-12-02 01:53, H200): one 2-D copy 0.908x the copy engine (128-row boxes, 3 programs per
SM) against 0.85x for the shipped 1-D copy; the 2-D table over 4 MiB chunks 0.88x. Run 2 sweeps both
tables' programs per SM, stages and tiles.

Triton cuts a 1-D descriptor's 32 KiB tile into 256-element (2 KiB) boxes: 16 TMA operations per
tile. Viewing the bytes as rows of 128 B (16 int64, the widest swizzle) lets one box cover
``ROWS`` x 128 B (up to 32 KiB) in one operation. This compares, on one GPU, median of 5 (CUDA
events), for 1 GiB:
- the copy engine (torch ``copy_``: the ceiling);
- ``triton_tma``'s single copy and its batched table (4 MiB chunks), as shipped;
- the same with 2-D boxes, over a sweep of rows per box, warps, stages and programs per SM.
Run: ``python benchmarks/probes/tma_box.py``; prints JSON lines (``ratio``: ceiling / ms).
"""

from __future__ import annotations

import json
import statistics

import triton
import triton.language as tl

from flashboot.kernels.copy_table import _row_by_search

COLS = 16
"""int64 per box row: 128 B, the widest swizzle span."""


@triton.jit
def copy_tma2d_kernel(dst_ptr, src_ptr, n_rows, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    src = tl.make_tensor_descriptor(src_ptr, shape=[n_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    dst = tl.make_tensor_descriptor(dst_ptr, shape=[n_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    for tile in range(pid, tl.cdiv(n_rows, ROWS), nprog):
        dst.store([tile * ROWS, 0], src.load([tile * ROWS, 0]))


@triton.jit
def copy_table_tma2d_kernel(table_ptr, n_entries: tl.int64, n_tiles: tl.int64, ROWS: tl.constexpr,
                            COLS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    t = pid * n_tiles // nprog
    t_end = (pid + 1) * n_tiles // nprog
    entry = _row_by_search(table_ptr, n_entries, t)
    while t < t_end:
        row = table_ptr + entry * 4
        dst_p = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int64)), 16)
        src_p = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int64)), 16)
        n_rows = tl.load(row + 2) // (8 * COLS)
        first = tl.load(row + 3)
        row_end = tl.minimum(first + (n_rows + ROWS - 1) // ROWS, t_end)
        src = tl.make_tensor_descriptor(src_p, shape=[n_rows.to(tl.int32), COLS], strides=[COLS, 1],
                                        block_shape=[ROWS, COLS])
        dst = tl.make_tensor_descriptor(dst_p, shape=[n_rows.to(tl.int32), COLS], strides=[COLS, 1],
                                        block_shape=[ROWS, COLS])
        for tile in range(t, row_end):
            r = ((tile - first) * ROWS).to(tl.int32)
            dst.store([r, 0], src.load([r, 0]))
        t = row_end
        entry += 1


def main() -> None:
    import torch

    from flashboot.kernels.copy import _ensure_tma_allocator
    from flashboot.kernels.copy_table import CopyTable
    from flashboot.kernels.views import sm_count
    from flashboot.memory import Device
    from flashboot.movers import create_mover

    n = 1 << 30
    chunk = 4 << 20
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    b = torch.zeros_like(a)
    sms = sm_count(0)
    _ensure_tma_allocator()

    def time_ms(fn, reps: int = 11) -> float:
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
        return statistics.median(out)

    def emit(what: str, ms: float, ok: bool = True, **kw) -> None:
        print(json.dumps({"what": what, "ms": round(ms, 4), "ratio": round(ceiling / ms, 4), "bit_exact": ok, **kw}),
              flush=True)

    ceiling = time_ms(lambda: b.copy_(a))
    print(json.dumps({"what": "ceiling (copy_)", "ms": round(ceiling, 4), "gbps": round(n / ceiling / 1e6, 1)}))
    tma = create_mover("triton_tma")
    b.zero_()
    emit("triton_tma single (shipped)", time_ms(lambda: tma.copy(b, a, stream=torch.cuda.current_stream())),
         torch.equal(a, b))
    chunks = [(o, o, chunk) for o in range(0, n, chunk)]
    b.zero_()
    emit("triton_tma batched 4 MiB (shipped)",
         time_ms(lambda: tma.copy_batch(b, a, chunks, stream=torch.cuda.current_stream())), torch.equal(a, b))

    rows = n // (8 * COLS)
    a64, b64 = a.view(torch.int64), b.view(torch.int64)
    for box_rows, warps, stages, per_sm in ((128, 4, 4, 3), (256, 4, 2, 3), (256, 4, 3, 2)):  # run 1's best
        grid = (min(sms * per_sm, -(-rows // box_rows)),)
        b.zero_()
        ms = time_ms(lambda: copy_tma2d_kernel[grid](b64, a64, rows, ROWS=box_rows, COLS=COLS, num_warps=warps,
                                                     num_stages=stages))
        emit("2d single", ms, torch.equal(a, b), rows=box_rows, warps=warps, stages=stages, per_sm=per_sm)
    dev = Device.parse("cuda:0")
    table_rows = [(b.data_ptr() + o, a.data_ptr() + o, chunk) for o, _, _ in chunks]
    handle = torch.cuda.current_stream().cuda_stream
    for block in (16384, 32768, 65536):  # the shipped 1-D table kernel, prepared once
        for stages in (2, 3, 4):
            for per_sm in (2, 3, 4):
                t = CopyTable(table_rows, device=dev, kind="tma", block_bytes=block, num_warps=4, num_stages=stages,
                              programs_per_sm=per_sm)
                b.zero_()
                try:
                    ms = time_ms(lambda: t.launch(handle))
                except Exception as exc:  # noqa: BLE001 - a probe reports what did not compile
                    print(json.dumps({"what": "1d table", "block": block, "error": str(exc)[:300]}))
                    continue
                emit("1d table 4 MiB", ms, torch.equal(a, b), block=block, warps=4, stages=stages, per_sm=per_sm)
    for box_rows in (128, 256):
        for stages in (2, 3, 4):
            for per_sm in (2, 3, 4):
                t = CopyTable(table_rows, device=dev, kind="tma", block_bytes=box_rows * COLS * 8, num_warps=4,
                              num_stages=stages, programs_per_sm=per_sm)
                b.zero_()
                try:
                    ms = time_ms(lambda: copy_table_tma2d_kernel[t.grid](t.table, t.n_entries, t.n_tiles,
                                                                         ROWS=box_rows, COLS=COLS,
                                                                         num_warps=4, num_stages=stages))
                except Exception as exc:  # noqa: BLE001
                    print(json.dumps({"what": "2d table", "rows": box_rows, "error": str(exc)[:300]}))
                    continue
                emit("2d table 4 MiB", ms, torch.equal(a, b), rows=box_rows, warps=4, stages=stages, per_sm=per_sm)
    print(json.dumps({"what": "ceiling again", "ms": round(time_ms(lambda: b.copy_(a)), 4)}))


if __name__ == "__main__":
    main()
