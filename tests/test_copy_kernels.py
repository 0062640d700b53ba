"""The Triton copy kernels: byte-exact for any size and offset, nothing written past the range.

They run where kernels run: CUDA tensors on a GPU, host memory under TRITON_INTERPRET=1 otherwise.
"""

import numpy as np
import pytest
import torch

from flashboot import FlashBootError, MoverError
from flashboot._cuda import cuda_available
from flashboot.kernels import copy as kc
from flashboot.memory import span_of

KERNEL_DEVICE = "cuda" if cuda_available() else "cpu"
GUARD = 64
POISON = 0xA5
SMALL = dict(block_bytes=256)  # many tiles per copy under the interpreter


def make_pair(nbytes, src_off, dst_off, seed=0, device=KERNEL_DEVICE):
    """Random source bytes and a poisoned destination, each with guard bytes around the range."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, generator=g).to(device)
    dst = torch.full((nbytes + 2 * GUARD,), POISON, dtype=torch.uint8, device=device)
    return src, dst, span_of(src).sub(GUARD + src_off, nbytes), span_of(dst).sub(GUARD + dst_off, nbytes)


def assert_copied(src, dst, nbytes, src_off, dst_off):
    s, d = src.cpu().numpy(), dst.cpu().numpy()
    lo = GUARD + dst_off
    assert np.array_equal(d[lo:lo + nbytes], s[GUARD + src_off:GUARD + src_off + nbytes])
    assert (d[:lo] == POISON).all(), "bytes written before the destination range"
    assert (d[lo + nbytes:] == POISON).all(), "bytes written past the end of the destination range"


SIZES = [1, 3, 15, 16, 17, 31, 255, 256, 257, 1000, 4099, 33_333]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (3, 3), (8, 8), (1, 5), (2, 10), (8, 0), (4, 12), (15, 31)])
def test_sm_copy_exact(nbytes, src_off, dst_off):
    src, dst, s, d = make_pair(nbytes, src_off, dst_off, seed=nbytes)
    kc.sm_copy(d, s, stream=None, **SMALL)
    assert_copied(src, dst, nbytes, src_off, dst_off)


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (3, 3), (5, 21), (0, 16)])
def test_tma_copy_exact(nbytes, src_off, dst_off):
    src, dst, s, d = make_pair(nbytes, src_off, dst_off, seed=nbytes)
    kc.tma_copy(d, s, stream=None, **SMALL)
    assert_copied(src, dst, nbytes, src_off, dst_off)


def test_copy_partial_nbytes_and_default_tuning():
    src, dst, s, d = make_pair(5000, 0, 0)
    kc.sm_copy(d, s, 1234, stream=None)
    assert_copied(src, dst, 1234, 0, 0)
    src, dst, s, d = make_pair(5000, 0, 0, seed=1)
    kc.tma_copy(d, s, 4321, stream=None)
    assert_copied(src, dst, 4321, 0, 0)


def test_a_size_computed_with_numpy_is_the_int_it_holds():
    """sm_copy(d, s, np.int64(1234)) had been refused as "cannot copy 1234 bytes from a 5,000-byte
    source" (Mover.copy took it)."""
    src, dst, s, d = make_pair(5000, 0, 0)
    kc.sm_copy(d, s, np.int64(1234), stream=None)
    assert_copied(src, dst, 1234, 0, 0)
    src, dst, s, d = make_pair(5000, 0, 0, seed=1)
    kc.tma_copy(d, s, np.uint32(4321), stream=None)
    assert_copied(src, dst, 4321, 0, 0)
    for bad in (np.True_, np.float64(8.0), np.array([8]), np.array(8.0), np.array(True)):
        with pytest.raises(FlashBootError, match=r"cannot copy .* bytes from a 5,000-byte source"):
            kc.sm_copy(d, s, bad, stream=None)


def test_zero_bytes_writes_nothing():
    src, dst, s, d = make_pair(64, 0, 0)
    kc.sm_copy(d, s, 0, stream=None)
    kc.tma_copy(d, s, 0, stream=None)
    assert (dst.cpu().numpy() == POISON).all()


def test_tma_refuses_pointers_not_congruent_mod_16():
    _, _, s, d = make_pair(1000, 0, 8)
    with pytest.raises(MoverError, match=r"differ by 8 mod 16 bytes.*sm_copy"):
        kc.tma_copy(d, s, stream=None)


def test_copy_rejects_overruns():
    _, _, s, d = make_pair(100, 0, 0)
    with pytest.raises(FlashBootError, match="cannot copy 101 bytes from a 100-byte source"):
        kc.sm_copy(d, s, 101, stream=None)
    with pytest.raises(FlashBootError, match="cannot copy 50 bytes .* to a 40-byte destination"):
        kc.tma_copy(d.sub(0, 40), s, 50, stream=None)
    for bad in (True, 1.0, -1):  # True passed as the int 1 and copied one byte
        with pytest.raises(FlashBootError, match=rf"cannot copy {bad!r} bytes from a 100-byte source"):
            kc.sm_copy(d, s, bad, stream=None)


@pytest.mark.parametrize("copy", [kc.sm_copy, kc.tma_copy])
@pytest.mark.parametrize("shift", [16, -16, 0])
def test_overlapping_ranges_are_refused(copy, shift):
    """The programs copy tiles in any order: a forward overlap (shift 16) read tiles it had already
    overwritten and returned wrong bytes without an error."""
    buf = torch.arange(4096, dtype=torch.int32, device=KERNEL_DEVICE).view(torch.uint8)
    before = buf.clone()
    whole = span_of(buf)
    s, d = whole.sub(1024, 2048), whole.sub(1024 + shift, 2048)
    with pytest.raises(MoverError, match=rf"cannot copy 2,048 bytes from {s.ptr:#x} to {d.ptr:#x} on "
                                         rf"{whole.device}: the ranges overlap"):
        copy(d, s, stream=None, **SMALL)
    assert torch.equal(buf, before)
    copy(whole.sub(0, 1024), whole.sub(1024, 1024), stream=None, **SMALL)  # adjacent ranges do not overlap
    assert torch.equal(buf[:1024], before[1024:2048])


@pytest.mark.parametrize("copy", [kc.sm_copy, kc.tma_copy])
@pytest.mark.parametrize("gone", ["sleep", "close"])
def test_a_span_of_an_asleep_or_closed_arena_is_refused(copy, gone):
    """A span taken before sleep() or close() points at a range nothing backs: the copy segfaulted."""
    from flashboot import Arena, ArenaError

    arena = Arena.create(1 << 20, "cpu")
    span = arena.span(0, 4096)
    getattr(arena, gone)()
    state = "asleep" if gone == "sleep" else "closed"
    with pytest.raises(ArenaError, match=rf"copy: the destination: the span at {span.ptr:#x} \(4,096 bytes on cpu\) "
                                         rf"belongs to .*, which is {state}"):
        copy(span, torch.ones(4096, dtype=torch.uint8), stream=None, **SMALL)
    with pytest.raises(ArenaError, match=rf"copy: the source: .* which is {state}"):
        copy(torch.zeros(4096, dtype=torch.uint8), span, stream=None, **SMALL)
    if gone == "sleep":
        arena.close()


def test_tuning_knobs_checked():
    _, dst, s, d = make_pair(100, 0, 0)
    with pytest.raises(FlashBootError, match=r"unknown tuning knob\(s\) \['blocks'\]"):
        kc.sm_copy(d, s, stream=None, blocks=4)
    with pytest.raises(FlashBootError, match="block_bytes must be a power of two"):
        kc.tma_copy(d, s, stream=None, block_bytes=1000)
    with pytest.raises(FlashBootError, match="num_warps must be a power of two in 1..32, got 3"):
        kc.sm_copy(d, s, stream=None, num_warps=3)
    with pytest.raises(FlashBootError, match="programs_per_sm must be a positive int, got 0"):
        kc.tma_copy(d, s, stream=None, programs_per_sm=0)
    assert (dst.cpu().numpy() == POISON).all()  # refused before any launch


def test_span_tensor_is_a_view():
    buf = torch.zeros(64, dtype=torch.uint8, device=KERNEL_DEVICE)
    v = kc.span_tensor(span_of(buf), 4, 8, 16)
    assert v.dtype == torch.int32 and v.numel() == 4 and v.data_ptr() == buf.data_ptr() + 8
    v.fill_(-1)
    host = buf.cpu().numpy()
    assert (host[8:24] == 255).all() and (host[:8] == 0).all() and (host[24:] == 0).all()
    with pytest.raises(FlashBootError, match="cannot view 6 bytes as 4-byte integers"):
        kc.span_tensor(span_of(buf), 4, 0, 6)
    with pytest.raises(FlashBootError, match="outside the 64-byte span"):
        kc.span_tensor(span_of(buf), 1, 60, 8)


@pytest.mark.skipif(cuda_available(), reason="host memory is refused only when kernels really run on a GPU")
def test_interpreter_flag_is_what_allows_host_memory(monkeypatch):
    from flashboot import CapabilityError

    _, _, s, d = make_pair(64, 0, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(CapabilityError, match="Triton kernels need CUDA memory.*'host' mover"):
        kc.sm_copy(d, s, stream=None)


# ------------------------------------------------------------------------------------ real GPU
@pytest.mark.gpu
@pytest.mark.parametrize("copy", [kc.sm_copy, kc.tma_copy])
def test_gpu_d2d_256mb_odd_tail(copy):
    nbytes = (256 << 20) + 13
    src = torch.randint(0, 256, (nbytes + 2 * GUARD,), dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, POISON)
    torch.cuda.synchronize()  # the fill ran on the default stream; the copy runs on another
    stream = torch.cuda.Stream(device=0)
    copy(span_of(dst).sub(GUARD + 3, nbytes), span_of(src).sub(GUARD + 3, nbytes), stream=stream)
    stream.synchronize()
    assert torch.equal(dst[GUARD + 3:GUARD + 3 + nbytes], src[GUARD + 3:GUARD + 3 + nbytes])
    assert (dst[:GUARD + 3] == POISON).all() and (dst[GUARD + 3 + nbytes:] == POISON).all()


@pytest.mark.two_gpus
@pytest.mark.parametrize("copy", [kc.sm_copy, kc.tma_copy])
def test_p2p_pull_from_peer(copy):
    from flashboot.movers.triton_sm import ensure_peer_access

    nbytes = (64 << 20) + 5
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda:1")
    ensure_peer_access(1, span_of(src))
    for i in (0, 1):
        torch.cuda.synchronize(i)
    stream = torch.cuda.Stream(device=1)
    copy(dst, src, stream=stream)
    stream.synchronize()
    assert torch.equal(dst.cpu(), src.cpu())


# --------------------------------------------------------------------- descriptor-table copies
def _table_case(kind, shift, seed):
    """A batch of chunks of assorted sizes (many tiles, short last tiles) between two buffers."""
    from flashboot.movers import create_mover

    sizes = [1, 15, 17, 256, 1000, 4099] if shift % 8 else [16, 48, 256, 1040, 4096, 32]
    chunks, d, s = [], 0, 8192
    for n in sizes:
        chunks.append((d + shift, s + shift, n))
        d += n + 16 + (-(n + 16)) % 16
        s -= n + 16 + (-(n + 16)) % 16
    src, dst, s_span, d_span = make_pair(16384, 0, 0, seed=seed)
    checker = "host" if d_span.device.kind == "cpu" else "copy_engine"  # any mover of the path validates it
    return src, dst, chunks, create_mover(checker).batch(d_span, s_span, chunks)


def assert_rows_copied(src, dst, rows):
    """Each ``(dst_offset, src_offset, nbytes)`` row landed (offsets past the guard) and no other byte changed."""
    s, d = src.cpu().numpy(), dst.cpu().numpy()
    expect = np.full_like(d, POISON)
    for do, so, n in rows:
        expect[GUARD + do:GUARD + do + n] = s[GUARD + so:GUARD + so + n]
    assert np.array_equal(d, expect)


@pytest.mark.parametrize("kind,shift", [("sm", 0), ("sm", 8), ("sm", 3), ("tma", 0)])
def test_table_copy_moves_every_row_exactly(kind, shift):
    from flashboot.kernels.copy_table import table_for

    src, dst, chunks, batch = _table_case(kind, shift, seed=shift + len(kind))
    knobs = {**(kc.TMA_TUNING if kind == "tma" else kc.SM_TUNING), **SMALL}
    table = table_for(batch, kind=kind, knobs=knobs)
    # no more programs than tiles (the interpreter's grid is smaller than the tiles: programs stride over rows)
    assert table.n_entries == len(chunks) and table.grid[0] <= table.n_tiles
    assert table.elem_bytes == {0: 8, 8: 8, 3: 1}[shift] and table.align16 == (shift == 0)
    table.launch(0)
    assert_rows_copied(src, dst, chunks)


@pytest.mark.parametrize("programs_per_sm", [1, 3, 40])
def test_tma_table_programs_find_their_rows_wherever_their_tiles_start(programs_per_sm):
    # 4 "SMs" under the interpreter: 4, 12 or 160 programs over ~90 tiles of 23 rows, so a program's
    # contiguous run of tiles starts mid-row (its first row found by binary search), crosses rows,
    # or is empty.
    from flashboot.kernels.copy_table import CopyTable

    sizes = [16 * (1 + (7 * i) % 40) for i in range(23)]
    total = sum(sizes)
    src, dst, s_span, d_span = make_pair(total, 0, 0, seed=programs_per_sm)
    rows, off = [], 0
    for n in sizes:
        rows.append((d_span.ptr + off, s_span.ptr + total - off - n, n))  # reversed placement
        off += n
    table = CopyTable(np.array(rows), device=d_span.device, kind="tma", block_bytes=64, num_warps=4, num_stages=1,
                      programs_per_sm=programs_per_sm)
    assert table.n_tiles > 80
    table.launch(0)
    s, d = src.cpu().numpy()[GUARD:GUARD + total], dst.cpu().numpy()
    off, expect = 0, np.full_like(d, POISON)
    for n in sizes:
        expect[GUARD + off:GUARD + off + n] = s[total - off - n:total - off]
        off += n
    assert np.array_equal(d, expect)


def test_tma_table_refuses_an_unaligned_row():
    from flashboot.kernels.copy_table import table_for

    _, _, _, batch = _table_case("sm", 3, seed=1)
    with pytest.raises(MoverError, match=r"TMA table: row 0 \(dst 0x[0-9a-f]+, src 0x[0-9a-f]+, nbytes 1\) is not "
                                         "16-byte aligned.*use 'triton_sm' or 'copy_engine'"):
        table_for(batch, kind="tma", knobs=kc.TMA_TUNING)


def test_tma_tables_take_their_programs_per_sm_and_sm_tables_keep_theirs():
    """table_for: a TMA table's grid follows its knobs' programs per SM (TMA_TABLE_TUNING's 3 for
    the mover's batches); the SM table keeps PROGRAMS_PER_SM whatever its knobs say."""
    from flashboot.kernels.copy_table import PROGRAMS_PER_SM, table_for
    from flashboot.kernels.views import sm_count

    _, _, _, batch = _table_case("tma", 0, seed=5)
    sms = sm_count(batch.dst.device.index if batch.dst.device.is_cuda else 0)
    for per_sm in (1, kc.TMA_TABLE_TUNING["programs_per_sm"]):
        table = table_for(batch, kind="tma", knobs={**kc.TMA_TABLE_TUNING, **SMALL, "programs_per_sm": per_sm})
        assert table.grid[0] == min(sms * per_sm, table.n_tiles)
    sm_table = table_for(batch, kind="sm", knobs={**kc.SM_TUNING, **SMALL, "programs_per_sm": 1})
    assert sm_table.grid[0] == min(sms * PROGRAMS_PER_SM, sm_table.n_tiles)


@pytest.mark.gpu
def test_tma_mover_batches_take_the_table_knobs_unless_it_is_tuned():
    from flashboot.movers.triton_tma import TritonTMAMover

    assert TritonTMAMover().table_tuning == kc.TMA_TABLE_TUNING
    tuned = TritonTMAMover(block_bytes=4096, programs_per_sm=1)
    assert tuned.table_tuning == tuned.tuning and tuned.tuning["block_bytes"] == 4096


def test_a_table_of_pieces_copies_those_pieces_only():
    """table_for(entries=...): the rows the TMA ring leaves (pieces of the batch's chunks) and no other byte."""
    from flashboot.kernels.copy_table import table_for

    src, dst, chunks, batch = _table_case("tma", 0, seed=9)
    pieces = np.array([(d + n // 32 * 16, s + n // 32 * 16, n - n // 32 * 16) for d, s, n in chunks], dtype=np.int64)
    table = table_for(batch, kind="tma", knobs={**kc.TMA_TABLE_TUNING, **SMALL}, entries=pieces)
    assert table.n_entries == len(pieces)
    table.launch(0)
    assert_rows_copied(src, dst, pieces)
