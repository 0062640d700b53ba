"""Mover registry invariants over every registered mover, the shared validation in Mover.copy,
and the host mover byte for byte. GPU copies are in test_arena_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashboot.movers  # noqa: F401  (registers every built-in mover)
from flashboot import Arena, ArenaError, CapabilityError, Device, MoverError, UnknownNameError
from flashboot._cuda import cuda_available
from flashboot.memory import PATHS, Span
from flashboot.movers import Mover, create_mover, list_movers, mover_class, movers_for
from flashboot.movers.registry import _MOVERS

BUILT_IN = {"copy_engine", "host", "triton_sm", "triton_tma"}
CPU, GPU0, GPU1 = Device("cpu"), Device("cuda", 0), Device("cuda", 1)
DEVICES_OF_PATH = {"h2d": (CPU, GPU0), "d2h": (GPU0, CPU), "d2d": (GPU0, GPU0), "p2p": (GPU0, GPU1), "host": (CPU, CPU)}
"""(source, destination) devices for each path."""

ALL = sorted(_MOVERS)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 253).astype(np.uint8)


def spans_for(path: str, nbytes: int, keep: list) -> tuple[Span, Span]:
    """(dst, src) spans of ``path`` over real host buffers (validation never touches the bytes,
    but if it wrongly let a copy through, the pointers are still valid memory)."""
    src_dev, dst_dev = DEVICES_OF_PATH[path]
    src, dst = np.zeros(nbytes + 64, np.uint8), np.zeros(nbytes + 64, np.uint8)
    keep += [src, dst]
    return Span(dst.ctypes.data, nbytes, dst_dev), Span(src.ctypes.data, nbytes, src_dev)


def instance(name: str):
    """The mover, constructed normally where it can run; else built without its availability
    check, which is enough to exercise the validation in ``Mover.copy``."""
    cls = mover_class(name)
    if cls.availability()[0]:
        return create_mover(name)
    return cls.__new__(cls)


# ---------------------------------------------------------------------------------------------
# Registry invariants, for every registered mover
# ---------------------------------------------------------------------------------------------


def test_built_in_movers_are_registered():
    assert BUILT_IN <= set(_MOVERS)


@pytest.mark.parametrize("name", ALL)
def test_mover_declares_itself_as_data(name):
    cls = _MOVERS[name]
    assert cls.name == name and mover_class(name) is cls
    assert cls.paths and set(cls.paths) <= set(PATHS), cls.paths
    assert isinstance(cls.alignment, int) and cls.alignment >= 1
    ok, reason = cls.availability()
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok or reason, f"{name} is unavailable but does not say why"
    assert (cls.__doc__ or "").strip(), f"{name} has no docstring"
    for path in cls.paths:
        assert name in movers_for(path)


def test_list_movers_matches_the_registry():
    infos = list_movers()
    assert [i.name for i in infos] == ALL
    for info in infos:
        cls = _MOVERS[info.name]
        assert set(info.paths) == set(cls.paths)
        assert (info.available, info.reason) == cls.availability()


def test_unknown_name_lists_every_known_name():
    with pytest.raises(UnknownNameError) as err:
        create_mover("warp_drive")
    message = str(err.value)
    assert "unknown mover 'warp_drive'" in message
    for name in ALL:
        assert name in message
    assert isinstance(err.value, KeyError)


@pytest.mark.parametrize("name", ALL)
def test_unavailable_mover_refuses_construction_with_its_reason(name):
    ok, reason = _MOVERS[name].availability()
    if ok:
        assert create_mover(name).name == name
    else:
        with pytest.raises(CapabilityError, match=f"mover '{name}' cannot run here: "):
            create_mover(name)


def test_copy_engine_availability_follows_cuda():
    ok, reason = mover_class("copy_engine").availability()
    if cuda_available():
        assert (ok, reason) == (True, "")
    else:
        assert (ok, reason) == (False, "no CUDA device; the host mover copies host->host")
    assert mover_class("copy_engine").paths == {"h2d", "d2h", "d2d", "p2p"}
    assert mover_class("host").paths == {"host"} and mover_class("host").availability() == (True, "")


@pytest.mark.parametrize("name", ALL)
def test_unsupported_path_names_what_is_supported_and_the_alternatives(name):
    mover, keep = instance(name), []
    unsupported = [p for p in PATHS if p not in mover.paths]
    for path in unsupported:
        dst, src = spans_for(path, 4096, keep)
        with pytest.raises(MoverError) as err:
            mover.copy(dst, src, 4096, stream=None)
        message = str(err.value)
        assert f"mover '{name}' cannot copy {path}" in message
        assert f"it supports {', '.join(sorted(mover.paths))}" in message
        assert f"movers for {path}: {', '.join(movers_for(path)) or 'none'}" in message


@pytest.mark.parametrize("name", ALL)
def test_sizes_are_validated_before_any_copy(name):
    mover, keep = instance(name), []
    path = sorted(mover.paths)[0]
    a = mover.alignment
    dst, src = spans_for(path, 64 * a, keep)
    for nbytes in (0, -a, 1.5, True):
        with pytest.raises(MoverError, match="nbytes must be a positive int"):
            mover.copy(dst, src, nbytes, stream=None)
    with pytest.raises(MoverError, match=rf"copy of {65 * a:,} bytes overruns the {64 * a:,}-byte source"):
        mover.copy(dst, src, 65 * a, stream=None)
    with pytest.raises(MoverError, match=rf"overruns the {32 * a:,}-byte destination"):
        mover.copy(dst.sub(0, 32 * a), src, 64 * a, stream=None)
    if a > 1:
        with pytest.raises(MoverError, match=f"needs {a}-byte aligned"):
            mover.copy(dst, src.sub(1, 32 * a), 32 * a, stream=None)


# ---------------------------------------------------------------------------------------------
# The host mover, byte for byte
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 7, 4095, 65537, (1 << 20) + 3, 3 * (1 << 20) + 12345])
@pytest.mark.parametrize("src_offset, dst_offset", [(0, 0), (1, 3), (13, 0)])
def test_host_mover_is_byte_exact_on_odd_sizes(nbytes, src_offset, dst_offset):
    src = torch.from_numpy(pattern(nbytes + 32, nbytes))
    dst = torch.full((nbytes + 64,), 0xEE, dtype=torch.uint8)
    create_mover("host").copy(dst[dst_offset:dst_offset + nbytes], src[src_offset:src_offset + nbytes])
    assert torch.equal(dst[dst_offset:dst_offset + nbytes], src[src_offset:src_offset + nbytes])
    assert bool((dst[:dst_offset] == 0xEE).all()) and bool((dst[dst_offset + nbytes:] == 0xEE).all())


def test_host_mover_between_host_arenas_and_arrays():
    mover = create_mover("host")
    n = 5 * (1 << 20) + 1
    with Arena.create(8 << 20, "cpu") as a, Arena.create(8 << 20, "cpu") as b:
        mover.copy(a.span(1, n), pattern(n, 1), stream=None)
        mover.copy(b, a)  # whole arena, span_of(arena)
        out = np.zeros(n, np.uint8)
        mover.copy(out, b.span(1, n))
        assert np.array_equal(out, pattern(n, 1))
        assert int(b.bytes()[0]) == 0 and int(b.bytes()[n + 1:].sum()) == 0


@pytest.mark.parametrize("shift", [1, -1, 4097, -(1 << 20) - 5])
def test_host_mover_handles_overlapping_ranges_like_memmove(shift):
    n = 3 << 20
    base = pattern(n + (4 << 20), 7)
    expected = base.copy()
    src_off = 2 << 20
    dst_off = src_off + shift
    expected[dst_off:dst_off + n] = base[src_off:src_off + n].copy()
    buf = torch.from_numpy(base)
    create_mover("host").copy(buf[dst_off:dst_off + n], buf[src_off:src_off + n])
    assert np.array_equal(buf.numpy(), expected)


def test_warming_the_host_mover_compiles_the_loop_its_copies_use():
    """warm_host_copy (a clone runs it while it connects) compiles the one signature that copies of
    1 MiB and more call, so a first copy does not compile (~0.6 s: a 2 MB clone's whole transfer)."""
    from flashboot.kernels.host_copy import copy_chunks
    from flashboot.movers.host import warm_host_copy

    warm_host_copy()
    compiled = list(copy_chunks.signatures)
    assert len(compiled) == 1
    n = 2 * (1 << 20) + 5
    out = np.zeros(n, np.uint8)
    create_mover("host").copy(out, pattern(n, 4))
    assert np.array_equal(out, pattern(n, 4))
    assert list(copy_chunks.signatures) == compiled, "the copy compiled another signature than the warm-up's"


# ---------------------------------------------------------------------------------------------
# The command line: `flashboot movers` and `flashboot info`
# ---------------------------------------------------------------------------------------------


def test_movers_command_prints_one_line_per_mover(capsys):
    from flashboot.cli import main

    assert main(["movers"]) == 0
    *lines, kernels = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(ALL) and kernels.startswith("Triton kernels (copy, checksum): ")
    for line, name in zip(lines, ALL):
        cls = _MOVERS[name]
        ok, reason = cls.availability()
        assert line.split()[0] == name
        assert " ".join(p for p in PATHS if p in cls.paths) in line
        assert line.endswith("available") if ok else line.endswith(f"unavailable: {reason}")
    assert main(["movers", "--json"]) == 0
    import json

    assert [m["name"] for m in json.loads(capsys.readouterr().out)] == ALL


def test_info_command_text_and_json(capsys):
    import json

    from flashboot.cli import main

    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in info["movers"]] == ALL
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ALL)
    if cuda_available():
        assert info["arena_backend"]["kind"] == "cuda" and info["devices"]
    else:
        assert info["cuda"] is None and info["devices"] == [] and info["no_cuda_reason"]
        assert info["arena_backend"] == {"kind": "host", "handle_type": "memfd", "granularity": 2 << 20}
        assert "CUDA: none (" in text and "host backend: memfd shared memory" in text


def test_info_without_cuda_names_the_reason(monkeypatch, capsys):
    import flashboot._cuda as c
    from flashboot.cli import main

    monkeypatch.setenv("FLASHBOOT_FORCE_HOST", "1")
    monkeypatch.setattr(c, "cuda_available", lambda: False)
    assert main(["info"]) == 0
    assert "CUDA: none (FLASHBOOT_FORCE_HOST=1 hides the CUDA devices)" in capsys.readouterr().out


class _RecordingMover(Mover):
    """Not registered: exercises the base class's validation without a GPU."""

    name = "recording"
    paths = frozenset({"d2d", "d2h"})

    def __init__(self):
        super().__init__()
        self.calls = []

    def _copy(self, dst, src, nbytes, path, stream):
        self.calls.append((nbytes, path))


def test_base_refuses_stream_of_another_device():
    class FakeStream:
        device = torch.device("cuda", 1)

    mover = _RecordingMover()
    g0 = Span(1 << 20, 4096, Device("cuda", 0))
    with pytest.raises(MoverError, match=r"d2d copy runs on cuda:0 but the stream belongs to cuda:1"):
        mover.copy(g0.sub(0, 2048), g0.sub(2048, 2048), stream=FakeStream())
    host = Span(1 << 22, 4096, Device("cpu"))
    with pytest.raises(MoverError, match=r"d2h copy runs on cuda:0 but the stream belongs to cuda:1"):
        mover.copy(host, g0, stream=FakeStream())
    assert mover.calls == []
    mover.copy(host, g0, 100, stream=None)  # raw/default stream: no device to check
    assert mover.calls == [(100, "d2h")]


# ---------------------------------------------------------------------------------------------
# Chunk batches: validated once, refused before any copy, naming the entry
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_batch_refuses_bad_entries_naming_them(name):
    mover, keep = instance(name), []
    path = sorted(mover.paths)[0]
    dst, src = spans_for(path, 4096, keep)
    cases = [
        ([(0, 0, 1024), (1024, 1024, 0)], r"chunk entry 1 \(dst_offset 1,024, src_offset 1,024, nbytes 0\) has no bytes"),
        ([(0, 0, 1024), (3584, 0, 1024)], r"chunk entry 1 \(dst_offset 3,584, .*\) ends past the 4,096-byte destination"),
        ([(0, 3584, 1024)], r"chunk entry 0 .* ends past the 4,096-byte source"),
        ([(0, 0, 1024), (2048, 0, 512), (1536, 512, 1024)],
         r"chunk entry 2 \(dst_offset 1,536, src_offset 512, nbytes 1,024\) overlaps the destination of chunk "
         r"entry 1 \(dst_offset 2,048"),
        ([(-16, 0, 16)], r"chunk entry 0 .* starts before the destination"),
        ([], r"non-empty list of \(dst_offset, src_offset, nbytes\)"),
        ([(0, 0)], r"non-empty list"),
        # the end of an entry whose offset + nbytes wraps int64 was negative, passed, and the copy
        # segfaulted
        ([(1, 1, 2**63 - 1)], r"chunk entry 0 \(dst_offset 1, src_offset 1, nbytes 9,223,372,036,854,775,807\) ends "
                              r"past the 4,096-byte destination"),
        ([(0, 2**63 - 1024, 1024)], r"chunk entry 0 .* ends past the 4,096-byte source"),
        ([(0, 0, 1024), (0.5, 0, 10.9)], r"64-bit integers; entry 1 is \(0.5, 0, 10.9\)"),  # was (0, 0, 10)
        ([(0, 0, 2**64)], r"64-bit integers; entry 0 is \(0, 0, 18446744073709551616\)"),
        (np.array([[0, 0, 2**63]], np.uint64), r"exceeds 9,223,372,036,854,775,807 bytes"),
    ]
    for chunks, message in cases:
        with pytest.raises(MoverError, match=message):
            mover.batch(dst, src, chunks)


def test_a_span_of_a_closed_arena_is_refused_by_copy_and_batch():
    """Spans and batches taken before close() pointed at a range given back: the copy segfaulted."""
    mover = create_mover("host")
    src, dst = Arena.create(1 << 20, "cpu"), Arena.create(1 << 20, "cpu")
    src_span, dst_span = src.span(0, 4096), dst.span(0, 4096)
    batch = mover.batch(dst_span, src_span, [(0, 0, 4096)])
    src.close()
    with pytest.raises(ArenaError, match=r"host: the source: the span at 0x[0-9a-f]+ \(4,096 bytes on cpu\) belongs to "
                                         r".*, which is closed"):
        mover.copy(dst_span, src_span, stream=None)
    with pytest.raises(ArenaError, match="host: the batch's source: .* which is closed"):
        batch.run(stream=None)
    dst.close()
    with pytest.raises(ArenaError, match="host: the destination: .* which is closed"):
        mover.copy(dst_span, np.zeros(4096, np.uint8), stream=None)


def test_batch_refuses_a_destination_over_another_entrys_source():
    buf, mover = np.zeros(8192, np.uint8), create_mover("host")
    span = Span(buf.ctypes.data, buf.nbytes, CPU)
    with pytest.raises(MoverError, match=r"chunk entry 1 \(dst_offset 4,032, src_offset 100, nbytes 512\) writes over "
                                         r"the source of chunk entry 0 \(dst_offset 0, src_offset 4,000"):
        mover.batch(span, span, [(0, 4000, 64), (4032, 100, 512)])
    mover.batch(span, span, [(0, 4096, 1024), (1024, 4096, 1024)])  # two entries may read the same bytes


def test_batch_refuses_misaligned_entries_for_an_aligned_mover():
    class Aligned(Mover):
        name, paths, alignment = "aligned_for_test", frozenset({"host"}), 16

    keep = []
    dst, src = spans_for("host", 4096, keep)
    with pytest.raises(MoverError, match=r"chunk entry 1 \(dst_offset 1,024, src_offset 1,030, nbytes 16\) is not "
                                         r"16-byte aligned"):
        Aligned().batch(dst, src, [(0, 0, 32), (1024, 1030, 16)])


@pytest.mark.parametrize("as_array", [False, True])
def test_host_batch_copies_every_chunk_and_nothing_else(as_array):
    src_np = pattern(1 << 20, 7)
    dst_np = np.full(1 << 20, 0xEE, np.uint8)
    chunks = [(0, 4096, 4096), (8192, 0, 3), (100_000, 500_000, 300_001), (700_001, 1, 65_536)]
    batch = create_mover("host").batch(dst_np, src_np, np.array(chunks) if as_array else chunks)
    assert len(batch) == 4 and batch.total_nbytes == sum(n for _, _, n in chunks)
    batch.run(stream=None)
    expect = np.full(1 << 20, 0xEE, np.uint8)
    for d, s, n in chunks:
        expect[d:d + n] = src_np[s:s + n]
    assert np.array_equal(dst_np, expect)
    dst_np[:] = 0xEE
    batch.copy_chunk(2, stream=None)  # one entry, no checks again
    assert np.array_equal(dst_np[100_000:400_001], src_np[500_000:800_001])
    assert (dst_np[:100_000] == 0xEE).all() and (dst_np[400_001:] == 0xEE).all()
    dst_np[:] = 0xEE
    for i in (4, -1):  # -1 had copied the last entry
        with pytest.raises(MoverError, match=rf"no chunk {i} in a batch of 4"):
            batch.copy_chunk(i, stream=None)
    assert (dst_np == 0xEE).all()


def test_every_mover_says_how_it_batches():
    infos = {i.name: i for i in list_movers()}
    for name in ALL:
        assert mover_class(name).batched and infos[name].batched == mover_class(name).batched, name
    assert "cuMemcpyBatchAsync" in infos["copy_engine"].batched
    assert "descriptor table" in infos["triton_sm"].batched and "descriptor table" in infos["triton_tma"].batched


def test_best_mover_picks_the_first_available_mover_of_the_path_in_preference_order(monkeypatch):
    import flashboot._cuda as cuda
    from flashboot.movers import best_mover, registry

    host = best_mover("cpu")
    assert host.name == "host" and best_mover("cpu", "cpu").name == "host"
    a, b = np.arange(4096).astype(np.uint8), np.zeros(4096, np.uint8)
    host.copy(b, a, stream=None)
    assert np.array_equal(a, b)

    # d2d on a (pretended) GPU: the ranking skips what cannot run here, in PREFERENCE order.
    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(registry, "create_mover", lambda name, **options: name)  # rank, do not construct
    runs = {"copy_engine": False, "triton_sm": True, "triton_tma": True}
    for name in runs:
        monkeypatch.setattr(_MOVERS[name], "availability",
                            classmethod(lambda cls: (runs[cls.name], "" if runs[cls.name] else f"{cls.name} is off")))
    assert best_mover("cuda:0") == "triton_sm"
    runs["copy_engine"] = True
    assert best_mover("cuda:0", "cuda:0") == "copy_engine"
    runs.update(dict.fromkeys(runs, False))
    with pytest.raises(CapabilityError) as e:
        best_mover("cuda:0")
    assert "no mover copies d2d" in str(e.value)
    for name in movers_for("d2d"):
        assert f"{name}: {name} is off" in str(e.value)


def test_copy_engine_batch_stream_groups_cover_every_chunk_once():
    from flashboot.movers.copy_engine import stream_groups

    rng = np.random.default_rng(4)
    for n, streams in ((256, 4), (7, 3), (1, 4), (5, 8), (1000, 16)):
        sizes = rng.integers(1, 1 << 20, n)
        groups = stream_groups(sizes, streams)
        assert 1 <= len(groups) <= streams
        assert groups[0][0] == 0 and groups[-1][1] == n and all(b > a for a, b in groups)
        assert all(groups[i][1] == groups[i + 1][0] for i in range(len(groups) - 1))  # contiguous, no gap or overlap
    equal = stream_groups(np.full(256, 4 << 20), 4)
    assert equal == [(0, 64), (64, 128), (128, 192), (192, 256)]  # equal chunks: equal shares


@pytest.mark.parametrize("bad", [0, 17, 2.0, "4"])
def test_copy_engine_refuses_a_bad_batch_stream_count(bad):
    with pytest.raises(MoverError, match=rf"batch_streams must be an int in 1..16, got {bad!r}"):
        create_mover("copy_engine", batch_streams=bad)


def test_contiguous_runs_merge_only_entries_that_continue_both_ranges():
    from flashboot.movers.batch import contiguous_runs

    def runs(chunks):
        t = np.array(chunks, dtype=np.int64)
        return [tuple(map(int, r)) for r in zip(*contiguous_runs(t[:, 0], t[:, 1], t[:, 2]))]

    assert runs([(0, 100, 10), (10, 110, 20), (30, 130, 5)]) == [(0, 100, 35)]
    assert runs([(0, 100, 10), (10, 111, 20)]) == [(0, 100, 10), (10, 111, 20)]  # the source jumps
    assert runs([(0, 100, 10), (11, 110, 20)]) == [(0, 100, 10), (11, 110, 20)]  # the destination jumps
    assert runs([(10, 110, 10), (0, 100, 10)]) == [(10, 110, 10), (0, 100, 10)]  # permuted: no merge
    assert runs([(0, 0, 4), (4, 4, 4), (100, 8, 4), (104, 12, 4), (108, 16, 4)]) == [(0, 0, 8), (100, 8, 12)]
    assert runs([(5, 6, 7)]) == [(5, 6, 7)]


def test_host_batch_merges_contiguous_chunks_byte_exact(monkeypatch):
    from flashboot.movers import host

    issued = []
    real = host.host_copy
    monkeypatch.setattr(host, "host_copy", lambda d, s, n: (issued.append(n), real(d, s, n)))
    total, chunk = 1 << 20, 64 << 10
    src_np, dst_np = pattern(total + 4096, 11), np.full(total, 0xEE, np.uint8)
    chunks = [(o, o + 4096, chunk) for o in range(0, total, chunk)]
    chunks[5], chunks[6] = chunks[6], chunks[5]  # one pair out of order: three runs
    create_mover("host").batch(dst_np, src_np, chunks).run(stream=None)
    assert np.array_equal(dst_np, src_np[4096:])
    assert issued == [5 * chunk, chunk, chunk, total - 7 * chunk]


def test_overlap_is_refused_before_runs_are_merged():
    buf = np.full(1 << 16, 0xEE, np.uint8)
    src = pattern(1 << 16, 12)
    # entries 0 and 1 would merge into one run; entry 2 lands on entry 1's destination
    with pytest.raises(MoverError, match=r"chunk entry 2 \(dst_offset 1,536, src_offset 8,192, nbytes 1,024\) overlaps "
                                         r"the destination of chunk entry 1 \(dst_offset 1,024"):
        create_mover("host").batch(buf, src, [(0, 0, 1024), (1024, 1024, 1024), (1536, 8192, 1024)])
    assert (buf == 0xEE).all()


def test_copy_engine_batch_issues_merged_runs_per_stream():
    """What the copy engine's batch issues (no GPU needed to build it): 256 contiguous chunks
    merge into one copy per stream group; unmerged, one copy per chunk; a permuted order stays apart."""
    from flashboot.movers.copy_engine import engine_copies

    total, chunk = 1 << 30, 4 << 20
    dst, src = Span(1 << 40, total, Device("cpu")), Span(2 << 40, total, Device("cpu"))
    chunks = [(o, o, chunk) for o in range(0, total, chunk)]
    batch = create_mover("host").batch(dst, src, chunks)
    assert engine_copies(batch, 1, True) == [([1 << 40], [2 << 40], [total])]
    four = engine_copies(batch, 4, True)
    assert [g[2] for g in four] == [[total // 4]] * 4 and [g[0][0] - (1 << 40) for g in four] == [0, 1 << 28, 2 << 28, 3 << 28]
    unmerged = engine_copies(batch, 1, False)
    assert len(unmerged[0][2]) == 256 and unmerged[0][0][:2] == [1 << 40, (1 << 40) + chunk]
    permuted = create_mover("host").batch(dst, src, chunks[::-1])
    assert len(engine_copies(permuted, 1, True)[0][2]) == 256


def test_copy_engine_batch_on_the_legacy_default_stream_goes_copy_by_copy(monkeypatch):
    """The driver refuses cuMemcpyBatchAsync on the legacy default stream (handle 0: what a
    ``stream=None`` run passes) with CUDA_ERROR_INVALID_VALUE: there the same copies go one
    cuMemcpyAsync each, in order; any other stream gets the one batched call. A group of one copy
    (a refit's whole image, its chunks merged) is a plain cuMemcpyAsync on any stream."""
    from flashboot.movers import copy_engine

    calls = []

    class Driver:
        CUstream = staticmethod(lambda handle: handle)

        def cuMemcpyBatchAsync(self, *args):
            calls.append(("batch", args[3], args[-1]))
            return (0,)

        def cuMemcpyAsync(self, dst, src, nbytes, handle):
            calls.append(("copy", dst, src, nbytes, handle))
            return (0,)

    engine = copy_engine._EngineBatch.__new__(copy_engine._EngineBatch)  # the driver's arguments, as built
    engine.drv, engine.method, engine.copies = Driver(), "cuMemcpyBatchAsync", 2
    monkeypatch.setattr(copy_engine._cuda, "check", lambda result, what: None)
    group = ([0x1000, 0x3000], [0x2000, 0x4000], [16, 32], 2, ["attrs"], [0], 1)
    engine._issue(group, 7)
    engine._issue(group, 0)
    engine._issue(([0x5000], [0x6000], [64], 1, ["attrs"], [0], 1), 7)
    assert calls == [("batch", 2, 7), ("copy", 0x1000, 0x2000, 16, 0), ("copy", 0x3000, 0x4000, 32, 0),
                     ("copy", 0x5000, 0x6000, 64, 7)]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_copy_engine_refuses_a_bad_merge_flag(bad):
    with pytest.raises(MoverError, match=rf"merge_contiguous must be a bool, got {bad!r}"):
        create_mover("copy_engine", merge_contiguous=bad)
