"""The movers used the way a researcher comparing them would: spans and batches kept across an
arena's sleep and close, odd chunk indices and entries, options a mover does not take. Each test
names the defect it pins (what happened before the fix)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flashboot.movers  # noqa: F401  (registers every built-in mover)
from flashboot import Arena, ArenaError, MoverError
from flashboot.movers import create_mover


def pattern(nbytes: int, seed: int = 7) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 253).astype(np.uint8)


def test_spans_and_batches_of_an_asleep_arena_are_refused_and_copy_again_after_wake():
    """A span or batch taken before sleep() pointed at a range nothing backs: copy, run and
    copy_chunk segfaulted (only a closed arena was checked)."""
    mover, src = create_mover("host"), pattern(8192)
    with Arena.create(1 << 20, "cpu") as arena:
        span = arena.span(0, 8192)
        batch = mover.batch(span, src, [(0, 0, 4096), (4096, 4096, 4096)])
        arena.sleep()
        asleep = r"host: the (batch's )?destination: the span at 0x[0-9a-f]+ \(8,192 bytes on cpu\) belongs to .*, " \
                 r"which is asleep \(nothing backs it\): wake\(\) it first"
        with pytest.raises(ArenaError, match=asleep):
            mover.copy(span, src, stream=None)
        with pytest.raises(ArenaError, match=asleep):
            batch.run(stream=None)
        with pytest.raises(ArenaError, match=asleep):
            batch.copy_chunk(1, stream=None)
        with pytest.raises(ArenaError, match=r"host: the source: .* which is asleep"):
            mover.copy(np.zeros(8192, np.uint8), span, stream=None)
        arena.wake()  # the same addresses, backed again: the batch copies
        batch.run(stream=None)
        assert np.array_equal(arena.bytes()[:8192].numpy(), src)


def test_copy_chunk_of_a_closed_arena_is_refused():
    """copy_chunk skipped the closed check run() makes: a chunk of a closed arena segfaulted."""
    mover = create_mover("host")
    arena = Arena.create(1 << 20, "cpu")
    batch = mover.batch(arena.span(0, 4096), pattern(4096), [(0, 0, 4096)])
    arena.close()
    with pytest.raises(ArenaError, match=r"host: the batch's destination: .* which is closed"):
        batch.copy_chunk(0, stream=None)


@pytest.mark.parametrize("index", [0.0, 1.5, "0", None, True, np.bool_(False), -1, 2])
def test_copy_chunk_refuses_an_index_that_is_not_an_entry_naming_it(index):
    """A float or a str raised a raw TypeError from inside the list lookup; True copied entry 1."""
    mover, src = create_mover("host"), pattern(64)
    dst = np.zeros(64, np.uint8)
    batch = mover.batch(dst, src, [(0, 0, 32), (32, 32, 32)])
    with pytest.raises(MoverError, match=re.escape(f"host: no chunk {index!r} in a batch of 2 (an int in 0..1)")):
        batch.copy_chunk(index, stream=None)
    assert not dst.any()
    batch.copy_chunk(np.int64(1), stream=None)  # a numpy integer is an index
    assert np.array_equal(dst[32:], src[32:]) and not dst[:32].any()


@pytest.mark.parametrize("chunks, entry", [
    ([(0, 0, 16), (True, 0, 16)], 1),  # np.asarray made an int array: dst_offset 1
    ([(0, 0, 16), (32, 0, np.True_)], 1),
    ([(np.int64(0), np.int32(0), np.uint8(16)), (32, 32, 16.0)], 1),  # numpy ints are integers: entry 1 is bad
])
def test_a_bool_in_a_chunk_list_of_ints_is_refused_naming_the_entry(chunks, entry):
    """A bool among ints made an int array and was copied as 1: chunk (True, 0, 16) went to byte 1."""
    dst = np.zeros(64, np.uint8)
    with pytest.raises(MoverError, match=re.escape(f"64-bit integers; entry {entry} is {tuple(chunks[entry])!r}")):
        create_mover("host").batch(dst, pattern(64), chunks)
    assert not dst.any()
    create_mover("host").copy_batch(dst, pattern(64), [(np.int64(0), np.int32(0), np.uint8(16))])
    assert np.array_equal(dst[:16], pattern(64)[:16])


def test_a_read_only_numpy_destination_is_refused():
    """np.frombuffer of bytes is read-only: copy and copy_batch wrote into the immutable bytes."""
    frozen = bytes(64)
    dst, mover = np.frombuffer(frozen, dtype=np.uint8), create_mover("host")
    message = r"host: the destination \(64 bytes at 0x[0-9a-f]+\) is a read-only numpy array"
    with pytest.raises(MoverError, match=message):
        mover.copy(dst, pattern(64))
    with pytest.raises(MoverError, match=message):
        mover.copy_batch(dst, pattern(64), [(0, 0, 64)])
    assert frozen == bytes(64)
    out = np.zeros(64, np.uint8)
    mover.copy(out, dst)  # a read-only source is fine
    assert not out.any()


def test_an_option_a_mover_does_not_take_is_refused_naming_the_mover_and_its_options():
    """create_mover("host", batch_streams=2) raised a raw TypeError naming Mover.__init__."""
    with pytest.raises(MoverError, match=r"mover 'host' takes no option 'batch_streams'; its options: none"):
        create_mover("host", batch_streams=2)
    with pytest.raises(MoverError, match=r"mover 'host' takes no option 'batch_streams'"):
        flashboot.movers.best_mover("cpu", batch_streams=2)
    with pytest.raises(MoverError, match=r"mover 'copy_engine' takes no option 'batch_stream', 'merge'; its options: "
                                         r"batch_streams, merge_contiguous"):
        create_mover("copy_engine", batch_stream=4, merge=False)


@pytest.mark.parametrize("bad", [True, False, -1, 10**30, None])
def test_copy_engine_refuses_a_bool_or_out_of_range_batch_stream_count(bad):
    """True passed as an int: batch_streams=True made one stream (checked before availability,
    so this runs without a GPU)."""
    with pytest.raises(MoverError, match=re.escape(f"batch_streams must be an int in 1..16, got {bad!r}")):
        create_mover("copy_engine", batch_streams=bad)


def test_registering_a_mover_with_an_unknown_path_is_refused():
    """paths={"H2D"} registered a mover that no copy, best_mover or movers_for would ever pick."""
    from flashboot import FlashBootError
    from flashboot.movers import Mover, register_mover
    from flashboot.movers.registry import _MOVERS

    class Typo(Mover):
        name, paths = "typo_for_test", frozenset({"H2D", "host"})

    with pytest.raises(FlashBootError, match=r"Typo declares unknown path\(s\) 'H2D'; known: h2d, d2h, d2d, p2p, host"):
        register_mover(Typo)
    assert "typo_for_test" not in _MOVERS


@pytest.mark.parametrize("name", ["triton_sm", "triton_tma"])
def test_triton_movers_refuse_overlapping_ranges(name):
    """Their kernels copy tiles in any order (sm_copy under the interpreter returned wrong bytes for a
    forward overlap); the copy went ahead without an error. Validation runs before any launch, so
    a mover built without its availability check shows it on host buffers labelled cuda:0."""
    from flashboot import Device
    from flashboot.memory import Span
    from flashboot.movers import mover_class

    cls = mover_class(name)
    mover = cls.__new__(cls)
    buf = np.zeros(8192, np.uint8)
    whole = Span(buf.ctypes.data, buf.nbytes, Device("cuda", 0))
    src, dst = whole.sub(0, 4096), whole.sub(16, 4096)
    with pytest.raises(MoverError, match=rf"{name}: the destination {dst.ptr:#x} and the source {src.ptr:#x} overlap "
                                         r"\(4,096 bytes on cuda:0\)"):
        mover.copy(dst, src, stream=None)
    with pytest.raises(MoverError, match=rf"{name}: the destination .* overlap \(16 bytes on cuda:0\)"):
        mover.copy(whole.sub(4, 16), whole.sub(0, 16), stream=None)


def test_the_host_mover_still_copies_overlapping_ranges_like_memmove():
    buf = pattern(4096)
    expected = buf.copy()
    expected[16:16 + 2048] = buf[:2048]
    create_mover("host").copy(buf[16:], buf[:2048], 2048)
    assert np.array_equal(buf, expected)


def test_a_batch_of_many_entries_reading_one_source_in_the_same_range_is_checked_in_one_pass(monkeypatch):
    """Entries whose sources overlap each other were checked by dropping one source per pass and
    sorting everything again: 16,000 entries reading one block took 3 s, 100,000 minutes, before
    any copy. Now the sources are sorted once (its verdicts are the same: fuzzed against pairs)."""
    from flashboot.movers import batch as batch_module

    searches = []
    for helper in ("_first_overlap", "_first_hit"):
        if hasattr(batch_module, helper):
            real = getattr(batch_module, helper)
            monkeypatch.setattr(batch_module, helper, lambda *a, real=real: searches.append(1) or real(*a))
    n, block = 2000, 64
    buf = np.zeros((n + 1) * block, np.uint8)
    buf[:block] = pattern(block)
    batch = create_mover("host").batch(buf, buf, [((i + 1) * block, 0, block) for i in range(n)])
    assert len(searches) <= 2  # destinations among themselves, then destinations against sources (was n + 1)
    batch.run(stream=None)
    assert np.array_equal(buf.reshape(n + 1, block), np.tile(pattern(block), (n + 1, 1)))
    # one more entry reads a block entry 999 writes (and writes the block everyone reads): the
    # first entry writing over a source is named, with the first entry reading it
    chunks = [((i + 1) * block, 0, block) for i in range(n)] + [(0, (n // 2) * block, block)]
    with pytest.raises(MoverError, match=rf"chunk entry {n // 2 - 1} \(dst_offset {n // 2 * block:,}, src_offset 0, "
                                         rf"nbytes 64\) writes over the source of chunk entry {n} \(dst_offset 0"):
        create_mover("host").batch(buf, buf, chunks)


@pytest.mark.parametrize("gone", ["sleep", "close"])
def test_copy_with_checksums_refuses_a_span_of_an_asleep_or_closed_arena(gone):
    """start_copy_with_checksums took the span's bare pointer: a span kept across sleep() or
    close() segfaulted (in the kernel under the interpreter, in host_copy without it)."""
    from flashboot.kernels.copy_verify import copy_with_checksums

    arena = Arena.create(1 << 20, "cpu")
    span = arena.span(0, 4096)
    getattr(arena, gone)()
    state = "asleep" if gone == "sleep" else "closed"
    with pytest.raises(ArenaError, match=rf"copy_with_checksums: the destination: .* which is {state}"):
        copy_with_checksums(span, pattern(4096), 1024)
    with pytest.raises(ArenaError, match=rf"copy_with_checksums: the source: .* which is {state}"):
        copy_with_checksums(np.zeros(4096, np.uint8), span, 1024)
    if gone == "sleep":
        arena.close()


def test_lazy_conjugate_and_negative_views_and_object_arrays_are_refused_as_sources():
    """A lazy ``conj()`` or ``_neg_view()`` shares its base's bytes, so a byte copy of it landed the
    unconjugated (un-negated) values; an object array's bytes are pointers into this heap."""
    import torch

    from flashboot.errors import FlashBootError

    mover = create_mover("host")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out = torch.zeros_like(z)
    with pytest.raises(FlashBootError, match=r"lazy conjugate view .*resolve_conj\(\)"):
        mover.copy(out, z.conj())
    with pytest.raises(FlashBootError, match=r"lazy negative view"):
        mover.copy(torch.zeros(2), torch._neg_view(torch.ones(2)))
    mover.copy(out, z.conj().resolve_conj())
    assert torch.equal(out, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    with pytest.raises(FlashBootError, match=r"dtype object holds Python objects"):
        mover.copy(np.zeros(2, dtype=object), np.array([object(), object()], dtype=object))


def test_a_chunk_table_given_as_a_tensor_is_converted_whole_and_a_bool_one_refused(monkeypatch):
    """A torch tensor of chunks was walked element by element (a list of row tensors, each row's
    0-d tensors); it is converted in one call, and a bool table is refused as a bool list is."""
    import torch

    mover, src = create_mover("host"), pattern(8192)
    dst = np.zeros(8192, np.uint8)
    table = torch.tensor([(0, 4096, 4096), (4096, 0, 4096)], dtype=torch.int64)
    monkeypatch.setattr(torch.Tensor, "__iter__", lambda self: pytest.fail("the tensor was walked"))
    mover.batch(dst, src, table).run(stream=None)
    assert np.array_equal(dst, np.concatenate([src[4096:], src[:4096]]))
    with pytest.raises(MoverError, match=r"64-bit integers; entry 0 is \(True, False, True\)"):
        mover.batch(dst, src, torch.tensor([(True, False, True)]))


def test_the_kernel_copies_refuse_a_read_only_numpy_destination(tmp_path):
    """copy_with_checksums (the host path: host_copy through the bare pointer) wrote into the
    immutable bytes of np.frombuffer, and a memory map opened "r" faulted; sm_copy and tma_copy
    (host memory under the interpreter) did the same. Mover.copy refused it already."""
    from flashboot.kernels import copy as kc
    from flashboot.kernels.copy_verify import copy_with_checksums

    frozen = bytes(64)
    dst = np.frombuffer(frozen, dtype=np.uint8)
    with pytest.raises(MoverError, match=r"copy_with_checksums: the destination \(64 bytes at 0x[0-9a-f]+\) is a "
                                         r"read-only numpy array"):
        copy_with_checksums(dst, pattern(64), 16)
    for copy in (kc.sm_copy, kc.tma_copy):
        with pytest.raises(MoverError, match=r"copy: the destination \(64 bytes at 0x[0-9a-f]+\) is a read-only"):
            copy(dst, pattern(64), stream=None)
    (tmp_path / "image").write_bytes(bytes(64))
    mapped = np.memmap(tmp_path / "image", dtype=np.uint8, mode="r")
    with pytest.raises(MoverError, match="read-only numpy array"):
        copy_with_checksums(mapped, pattern(64), 16)
    del mapped
    assert frozen == bytes(64) and (tmp_path / "image").read_bytes() == bytes(64)
    out = np.zeros(64, np.uint8)  # a read-only source is fine
    assert copy_with_checksums(out, dst, 16) == copy_with_checksums(np.zeros(64, np.uint8), np.zeros(64, np.uint8), 16)


def test_a_chunk_entry_of_other_than_three_values_is_named():
    """[(0, 0, 8), (8, 8)] was refused with numpy's "inhomogeneous shape after 1 dimensions. The
    detected shape was (2,) + inhomogeneous part", naming neither the entry nor what it held."""
    mover, dst, src = create_mover("host"), np.zeros(64, np.uint8), pattern(64)
    for chunks, named in (([(0, 0, 8), (8, 8)], "entry 1 is (8, 8), 2 value(s)"),
                          ([(0, 0, 8), (8, 8, 8, 8)], "entry 1 is (8, 8, 8, 8), 4 value(s)"),
                          ([(0, 0, 8), None], "entry 1 is None"),
                          ([(0, 0, 8, 1)], "entry 0 is (0, 0, 8, 1), 4 value(s)")):
        with pytest.raises(MoverError, match=re.escape(f"(dst_offset, src_offset, nbytes); {named}")):
            mover.copy_batch(dst, src, chunks)
    assert not dst.any()


def test_copy_engine_batch_streams_spread_a_batch_whose_first_chunk_is_over_its_share():
    """Cut before the chunk that passed each 1/streams of the bytes, a first chunk larger than its
    share swallowed every cut: batch_streams=2 over chunks of 6 and 4 MiB issued both on one
    stream, and 4 streams over (100, 1, 1, 1) MiB one as well (nothing said so)."""
    from flashboot.movers.copy_engine import stream_groups

    mib = 1 << 20
    assert stream_groups(np.array([6 * mib, 4 * mib]), 2) == [(0, 1), (1, 2)]
    assert stream_groups(np.array([100, 1, 1, 1]) * mib, 4) == [(0, 1), (1, 4)]
    assert stream_groups(np.array([40, 30, 30]) * mib, 3) == [(0, 1), (1, 2), (2, 3)]
    assert stream_groups(np.array([1, 1, 1, 100]) * mib, 4) == [(0, 3), (3, 4)]
    assert stream_groups(np.full(256, 4 * mib), 4) == [(0, 64), (64, 128), (128, 192), (192, 256)]


def test_chunk_offsets_of_numpy_uint64_beside_signed_ints_are_the_integers_they_are():
    """numpy makes float64 of np.uint64 beside a signed int: a chunk list whose offsets came from a
    uint64 array (a header's sizes) was refused as "must hold 64-bit integers; entry 0 is
    (np.uint64(8), 0, 8)" -- entry 0 named whatever it held."""
    mover, src = create_mover("host"), pattern(64)
    dst = np.zeros(64, np.uint8)
    mover.copy_batch(dst, src, [(np.uint64(8), 0, 8), (0, np.uint64(8), np.int64(8))])
    assert np.array_equal(dst[:16], np.concatenate([src[8:16], src[:8]])) and not dst[16:].any()
    for bad, entry in (([(0, 0, 8), (np.uint64(2**63), 0, 8)], 1), ([(np.uint64(8), 0, 8.0)], 0)):
        with pytest.raises(MoverError, match=rf"64-bit integers; entry {entry} is \(np.uint64"):
            mover.copy_batch(dst, src, bad)
