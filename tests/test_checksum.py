"""The checksum: numba host code and Triton kernels against the numpy definition.

Kernel tests run where the kernels run: on CUDA tensors when a GPU is present, otherwise on
host memory under TRITON_INTERPRET=1 (set by conftest).
"""

import numpy as np
import pytest
import torch

from flashboot import FlashBootError
from flashboot._cuda import cuda_available
from flashboot.kernels import checksum as ck
from flashboot.kernels import checksum_host as ckh
from flashboot.kernels.checksum_spec import GOLDEN32, LENGTH_MUL, M32, M64, MIX_Y, SALT_Y, checksum_reference, fmix32_np
from flashboot.memory import span_of

KERNEL_DEVICE = "cuda" if cuda_available() else "cpu"
SMALL = dict(block_words=64)  # many tiles per range under the interpreter


def random_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def formula_digest(raw: np.ndarray, start_word: int) -> int:
    """The spec's formula with word indices starting at ``start_word`` (Python ints for the indices)."""
    n = raw.size
    padded = np.concatenate([raw, np.zeros((-n) % 4, np.uint8)]).view("<u4").astype(np.uint64)
    idx = np.arange(padded.size, dtype=np.uint64) + np.uint64(start_word)
    lo, hi = idx & np.uint64(M32), idx >> np.uint64(32)
    with np.errstate(over="ignore"):
        x = fmix32_np(padded ^ ((lo * np.uint64(GOLDEN32)) & np.uint64(M32)))
        y = fmix32_np(((padded + lo * np.uint64(MIX_Y) + hi) & np.uint64(M32)) ^ np.uint64(SALT_Y))
        terms = int(((x << np.uint64(32)) | y).sum(dtype=np.uint64))
    return (n * LENGTH_MUL + terms) & M64


def on_kernel_device(raw: np.ndarray):
    """``raw`` as a uint8 tensor where the kernels run, with the span to hash."""
    t = torch.from_numpy(raw.copy()).to(KERNEL_DEVICE)
    return t


# ------------------------------------------------------------------------------------ host side
@pytest.mark.parametrize("n", list(range(0, 41)) + [63, 1023, 4097, 65537, 262147])
def test_host_matches_reference(n):
    raw = random_bytes(n, seed=n)
    assert ck.checksum_host(raw) == checksum_reference(raw.tobytes())


def test_host_accepts_buffers_and_unaligned_views():
    raw = random_bytes(10_001)
    expected = checksum_reference(raw[3:].tobytes())
    assert ck.checksum_host(raw[3:]) == expected  # unaligned uint32 words
    assert ck.checksum_host(raw[3:].tobytes()) == expected
    assert ck.checksum_host(bytearray(raw[3:].tobytes())) == expected
    assert ck.checksum_host(memoryview(raw)[3:]) == expected
    assert ck.checksum_host(span_of(raw).sub(3)) == expected
    assert ck.checksum_host(torch.from_numpy(raw)[3:]) == expected  # torch has no buffer protocol
    f = raw[:10_000].view(np.float32)
    assert ck.checksum_host(f) == checksum_reference(raw[:10_000].tobytes())


def test_host_word_indices_past_2_32():
    raw = random_bytes(3 * ck.HOST_BLOCK_WORDS * 4 + 5, seed=7)
    assert formula_digest(raw, 0) == checksum_reference(raw.tobytes())  # the formula here is the spec
    for start in (2**32 - ck.HOST_BLOCK_WORDS - 3, 2**32, 5 * 2**32 + 11):
        got = ckh._checksum_host_bytes(raw, start_word=start)
        assert got == formula_digest(raw, start)
    # hi enters only y: the same words at 2**32 hash differently from the same words at 0
    assert ckh._checksum_host_bytes(raw, start_word=2**32) != ckh._checksum_host_bytes(raw, start_word=0)


def test_sensitivity():
    raw = random_bytes(4096, seed=3)
    base = ck.checksum_host(raw)
    flipped = raw.copy()
    flipped[1234] ^= 0x10
    swapped = raw.copy().view("<u4")
    swapped[[10, 11]] = swapped[[11, 10]]
    assert swapped[10] != swapped[11]
    assert ck.checksum_host(flipped) != base
    assert ck.checksum_host(swapped) != base
    assert ck.checksum_host(np.concatenate([raw, np.zeros(1, np.uint8)])) != base
    zeros = [ck.checksum_host(np.zeros(n, np.uint8)) for n in range(0, 9)]
    assert len(set(zeros)) == len(zeros)


@pytest.mark.parametrize("chunk_bytes", [1, 3, 4, 6, 64, 1000, 4096, 1 << 20])
def test_host_chunks_match_reference(chunk_bytes):
    raw = random_bytes(2_003 if chunk_bytes < 8 else 20_003, seed=chunk_bytes)
    data = raw.tobytes()
    expected = [checksum_reference(data[s:s + chunk_bytes]) for s in range(0, len(data), chunk_bytes)]
    assert ck.chunk_checksums_host(raw, chunk_bytes) == expected
    assert ck.chunk_checksums(raw, chunk_bytes) == expected


def test_chunks_bad_input():
    assert ck.chunk_checksums_host(b"", 16) == []
    for bad in (0, -4, 2.5):
        with pytest.raises(FlashBootError, match="chunk_bytes must be a positive int"):
            ck.chunk_checksums_host(b"abcd", bad)
        with pytest.raises(FlashBootError, match="chunk_bytes must be a positive int"):
            ck.chunk_checksums(b"abcd", bad)


def test_chunk_sizes_computed_with_numpy_are_taken_and_a_bool_refused():
    """np.int64(16) had been refused as "must be a positive int"; True was taken as 1 (a digest per
    byte). copy_with_checksums refused np.int64 too."""
    from flashboot.kernels.copy_verify import copy_with_checksums

    raw = np.arange(100, dtype=np.uint8)
    expected = ck.chunk_checksums_host(raw, 16)
    assert ck.chunk_checksums_host(raw, np.int64(16)) == ck.chunk_checksums(raw, np.uint16(16)) == expected
    assert copy_with_checksums(np.zeros(100, np.uint8), raw, np.int64(16)) == expected
    for bad in (True, np.True_):
        with pytest.raises(FlashBootError, match="chunk_bytes must be a positive int, got"):
            ck.chunk_checksums_host(raw, bad)
        with pytest.raises(FlashBootError, match="chunk_bytes must be a positive int, got"):
            ck.chunk_checksums(raw, bad)


def test_checksum_dispatch_on_host_objects():
    raw = random_bytes(777)
    expected = checksum_reference(raw.tobytes())
    assert ck.checksum(raw) == expected
    assert ck.checksum(torch.from_numpy(raw)) == expected
    assert ck.checksum(raw.tobytes()) == expected
    assert ck.checksum(span_of(raw)) == expected


@pytest.mark.parametrize("seed", range(6))
def test_chunk_digests_summed_from_writes_equal_the_files(seed):
    """Disjoint writes at unaligned offsets, in random order, with gaps left as zeros: the digests
    summed from the writes are the chunk checksums of the finished bytes."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40)) * 4096
    chunk = int(rng.choice([4096, 12288, 65536]))
    cuts = sorted(set(rng.integers(0, n, 60).tolist()) | {0, n})
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if rng.random() < 0.7]
    rng.shuffle(pieces)
    buf = np.zeros(n, np.uint8)
    acc = ck.ChunkDigests(n, chunk)
    for a, b in pieces:
        data = random_bytes(b - a, seed=a)
        buf[a:b] = data
        acc.add(a, data if a % 2 else data.tobytes())
    assert acc.digests() == ck.chunk_checksums_host(buf, chunk)
    assert ck.ChunkDigests(n, chunk).digests() == ck.chunk_checksums_host(np.zeros(n, np.uint8), chunk)


def test_chunk_digests_refuse_overlapping_writes():
    from flashboot.errors import LayoutError

    acc = ck.ChunkDigests(8192, 4096)
    acc.add(0, random_bytes(100))
    acc.add(50, random_bytes(100))  # whole words 13..37 overlap the first write's
    with pytest.raises(LayoutError, match="overlap"):
        acc.digests()
    acc = ck.ChunkDigests(8192, 4096)
    acc.add(1, random_bytes(2))
    with pytest.raises(LayoutError, match="two writes of byte 2"):
        acc.add(2, random_bytes(1))
    acc = ck.ChunkDigests(8192, 4096)
    acc.add(1, random_bytes(2))  # a word partly written ...
    acc.add(0, random_bytes(8))  # ... inside another write
    with pytest.raises(LayoutError, match="partly written word"):
        acc.digests()
    with pytest.raises(FlashBootError, match="outside the 8,192-byte file"):
        acc.add(8190, random_bytes(4))
    with pytest.raises(FlashBootError, match="multiple of 4"):
        ck.ChunkDigests(8192, 4098)


def test_word_term_is_the_spec_on_one_word():
    for n in (1, 2, 3, 4):
        raw = random_bytes(n, seed=n)
        word = int.from_bytes(raw.tobytes() + b"\0" * (4 - n), "little")
        assert (n * LENGTH_MUL + ck.word_term(word, 0)) & M64 == checksum_reference(raw.tobytes())


# ---------------------------------------------------------------------------------- Triton side
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 255, 256, 257, 4099, 9_001])
@pytest.mark.parametrize("offset", [0, 1, 4, 6])
def test_kernel_matches_reference(n, offset):
    raw = random_bytes(n + offset, seed=n)
    t = on_kernel_device(raw)
    span = span_of(t).sub(offset, n)  # offsets 1 and 6 take the byte-load path
    assert ck.device_checksum(span, **SMALL) == checksum_reference(raw[offset:].tobytes())


def test_kernel_empty_range():
    t = on_kernel_device(random_bytes(16))
    assert ck.device_checksum(span_of(t).sub(4, 0)) == checksum_reference(b"") == 0
    assert ck.device_chunk_checksums(span_of(t).sub(4, 0), 8) == []


@pytest.mark.parametrize("offset", [0, 4, 1])
def test_kernel_word_indices_past_2_32(offset):
    block = SMALL["block_words"]
    raw = random_bytes(6 * block * 4 + 3 + offset, seed=11)
    t = on_kernel_device(raw)
    span = span_of(t).sub(offset)
    for start in (2**32 - 2 * block, 3 * 2**32):
        expected = formula_digest(raw[offset:], start)
        assert ck.device_checksum(span, start_word=start, **SMALL) == expected
        assert ckh._checksum_host_bytes(raw[offset:], start_word=start) == expected


def test_kernel_start_word_must_be_tile_aligned():
    t = on_kernel_device(random_bytes(64))
    with pytest.raises(FlashBootError, match="multiple of block_words"):
        ck.device_checksum(span_of(t), start_word=3, **SMALL)


@pytest.mark.parametrize("chunk_bytes", [256, 1000, 4096, 6, 50_000])
@pytest.mark.parametrize("offset", [0, 2])
def test_kernel_chunks_match_host(chunk_bytes, offset):
    raw = random_bytes((150 if chunk_bytes < 256 else 10_003) + offset, seed=chunk_bytes)
    t = on_kernel_device(raw)
    span = span_of(t).sub(offset)
    assert ck.device_chunk_checksums(span, chunk_bytes, **SMALL) == ck.chunk_checksums_host(raw[offset:], chunk_bytes)


@pytest.mark.parametrize("programs_per_sm", [1, 2, 3, 5, 64])
def test_kernel_digests_do_not_depend_on_the_grid(programs_per_sm):
    # 4 "SMs" under the interpreter: 4 to 256 programs, each a contiguous run of tiles that starts
    # and ends mid-chunk, crosses chunk ends and partial last tiles (1,000-byte chunks: 250 words,
    # 3 full tiles of 64 and one of 58), or gets no tile at all.
    raw = random_bytes(30 * 1000 + 6, seed=programs_per_sm)
    span = span_of(on_kernel_device(raw))
    found = ck.device_chunk_checksums(span, 1000, programs_per_sm=programs_per_sm, **SMALL)
    assert found == ck.chunk_checksums_host(raw, 1000)


def test_kernel_tuning_knobs_checked():
    t = on_kernel_device(random_bytes(64))
    with pytest.raises(FlashBootError, match="unknown checksum knob"):
        ck.device_checksum(span_of(t), blok_words=64)
    with pytest.raises(FlashBootError, match="power of two"):
        ck.device_checksum(span_of(t), block_words=100)


# ------------------------------------------------------------------------------------ real GPU
@pytest.mark.gpu
def test_gpu_checksum_1gb_matches_host():
    n = (1 << 30) + 3
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    host = t.cpu().numpy()
    expected = ck.checksum_host(host)
    stream = torch.cuda.Stream(device=0)
    assert ck.checksum(t, stream=stream) == expected
    assert ck.checksum(span_of(t)) == expected
    sub = span_of(t).sub(1, 1 << 20)  # unaligned start: byte-load path
    assert ck.checksum(sub) == ck.checksum_host(host[1:(1 << 20) + 1])


@pytest.mark.gpu
def test_gpu_chunk_checksums_match_host():
    n = (1 << 30) + 3
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    host = t.cpu().numpy()
    for chunk_bytes in (64 << 20, (48 << 20) + 4):
        assert ck.chunk_checksums(t, chunk_bytes) == ck.chunk_checksums_host(host, chunk_bytes)
    small = host[: 1 << 20]
    assert ck.chunk_checksums(t[: 1 << 20], 4097) == ck.chunk_checksums_host(small, 4097)


class _RecordingKernel:
    """Stands in for a Triton kernel: records launches (``kernel[grid](...)``) and warm-ups."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append(("launch", grid, args, kw))

    def warmup(self, *args, grid, **kw):
        self.calls.append(("warmup", grid, args, kw))


@pytest.mark.parametrize("nbytes, chunk_bytes", [
    (3 * 4096 + 12, 4096),  # sizes that are no multiple of 16 words
    (1 << 20, 1 << 16),  # all multiples of 16
    (4 * 1024 * 16, 4 * 1024 * 16),  # one chunk of exactly 16 tiles
    (4100, 4),  # one-word chunks: chunk_words == 1 and tiles_per_chunk == 1 specialise as constants
    (12_345, 1000),  # byte kernel: chunks of no whole word
])
def test_warm_chunk_checksums_prepares_the_launch_of_exactly_that_shape(monkeypatch, nbytes, chunk_bytes):
    """The served daemon warms the checksum for an image's own shapes at stage time. Triton compiles
    per specialisation of the sizes (1, multiples of 16) and pointers (16-byte aligned), so the
    warm-up must present the same grid, sizes, constants and aligned pointers as the real launch
    of that shape, or the engine's first verified load compiles again."""
    from flashboot.kernels import checksum_gpu, checksum_triton

    calls = []
    monkeypatch.setattr(checksum_triton, "checksum_words_kernel", _RecordingKernel(calls))
    monkeypatch.setattr(checksum_triton, "checksum_bytes_kernel", _RecordingKernel(calls))
    monkeypatch.setattr(checksum_gpu, "_sum_partials", lambda partials, n: [0] * n)
    t = on_kernel_device(random_bytes(nbytes))
    assert t.data_ptr() % 16 == 0
    checksum_gpu.device_chunk_checksums(span_of(t), chunk_bytes)  # the kernel path, on the host under the interpreter
    checksum_gpu.warm_chunk_checksums(0, nbytes, chunk_bytes)
    (kind, grid, args, kw), (warm_kind, warm_grid, warm_args, warm_kw) = calls
    assert (kind, warm_kind) == ("launch", "warmup")
    pointers = [a for a in args if isinstance(a, torch.Tensor)]
    warm_pointers = [a for a in warm_args if isinstance(a, torch.Tensor)]
    assert [p.dtype for p in pointers] == [p.dtype for p in warm_pointers]
    assert all(p.data_ptr() % 16 == 0 for p in pointers + warm_pointers)
    sizes = [a for a in args if not isinstance(a, torch.Tensor)]
    assert sizes == [a for a in warm_args if not isinstance(a, torch.Tensor)] and sizes
    assert kw == warm_kw
    if chunk_bytes % 4 == 0:  # the word kernel's grid is fixed by the sizes; the byte kernel's is not specialised on
        assert grid == warm_grid


@pytest.mark.gpu
def test_gpu_warm_chunk_checksums_leaves_nothing_to_build_for_that_shape():
    """After the warm-up of a shape, a checksum of that shape builds nothing more and matches the
    host: chunks of whole 64 bytes find the cubin loaded; others (Triton) compile nothing."""
    from flashboot.kernels import checksum_gpu, checksum_triton

    dev = torch.cuda.current_device()
    nbytes = (5 << 20) + 12
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    knobs = checksum_gpu.CHECKSUM_TUNING
    checksum_gpu.warm_chunk_checksums(dev, nbytes, 1 << 20)
    key = (dev, knobs["block_words"], knobs["num_warps"], knobs["num_stages"], False)
    assert checksum_gpu._launchers.get(key) is not None  # built or found, and loaded
    assert ck.chunk_checksums(t, 1 << 20) == ck.chunk_checksums_host(t.cpu().numpy(), 1 << 20)
    odd = (1 << 20) + 4  # not whole 16-word groups: Triton's launch, specialised on these sizes
    checksum_gpu.warm_chunk_checksums(dev, nbytes, odd)
    cache = checksum_triton.checksum_words_kernel.device_caches[dev][0]
    compiled = len(cache)
    assert ck.chunk_checksums(t, odd) == ck.chunk_checksums_host(t.cpu().numpy(), odd)
    assert len(cache) == compiled


def test_checksum_of_something_that_is_no_buffer():
    with pytest.raises(FlashBootError, match="cannot take a byte span of dict"):
        ck.checksum({"a": 1})
    with pytest.raises(FlashBootError, match="C-contiguous"):
        ck.checksum(np.zeros((4, 4), np.uint8)[:, 1])


# ------------------------------------------------------------------------ copy that checksums
@pytest.mark.parametrize("nbytes,chunk_bytes", [(4096, 1024), (5003, 1024), (3, 64), (70_000, 4096), (1000, 4000)])
def test_copy_with_checksums_copies_and_matches_the_checksum_kernel(nbytes, chunk_bytes):
    from flashboot.kernels.copy_verify import copy_with_checksums

    raw = random_bytes(nbytes, seed=nbytes)
    src = torch.from_numpy(raw).to(KERNEL_DEVICE)
    dst = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8, device=KERNEL_DEVICE)
    found = copy_with_checksums(dst, src, chunk_bytes, stream=None, **SMALL)
    out = dst.cpu().numpy()
    assert np.array_equal(out[:nbytes], raw) and (out[nbytes:] == 0xA5).all()
    # bit-identical to the checksum kernel and to the spec, chunk by chunk
    assert found == ck.chunk_checksums(span_of(dst).sub(0, nbytes), chunk_bytes, **SMALL)
    assert found == [checksum_reference(raw[o:o + chunk_bytes].tobytes()) for o in range(0, nbytes, chunk_bytes)]


def test_start_copy_with_checksums_returns_pending_digests_of_what_it_wrote():
    from flashboot.kernels.copy_verify import start_copy_with_checksums

    raw = random_bytes(9_002, seed=3)
    src = torch.from_numpy(raw).to(KERNEL_DEVICE)
    dst = torch.zeros(9_002, dtype=torch.uint8, device=KERNEL_DEVICE)
    pending = start_copy_with_checksums(dst, src, 2048, **SMALL)
    found = pending.digests()
    assert np.array_equal(dst.cpu().numpy(), raw)
    assert found == ck.chunk_checksums_host(raw, 2048) and pending.digests() == found
    assert start_copy_with_checksums(dst[:0], src[:0], 2048).digests() == []


def test_copy_verified_names_the_chunk_that_differs():
    from flashboot import ChecksumMismatchError
    from flashboot.kernels.copy_verify import copy_verified

    raw = random_bytes(8192, seed=5)
    expected = ck.chunk_checksums_host(raw, 2048)
    dst = torch.zeros(8192, dtype=torch.uint8, device=KERNEL_DEVICE)
    src = torch.from_numpy(raw).to(KERNEL_DEVICE)
    assert copy_verified(dst, src, expected, 2048, **SMALL) == expected
    wrong = list(expected)
    wrong[2] ^= 1
    with pytest.raises(ChecksumMismatchError, match=r"clone c1: chunk 2 \(bytes 4,096..6,144\) has checksum "
                                                    rf"{expected[2]:#018x}, expected {wrong[2]:#018x}") as info:
        copy_verified(dst, src, wrong, 2048, where="clone c1", **SMALL)
    assert info.value.chunk == 2 and info.value.offset == 4096


def test_copy_with_checksums_refuses_what_it_cannot_do():
    from flashboot import MoverError
    from flashboot.kernels.copy_verify import copy_with_checksums

    buf = torch.zeros(4096, dtype=torch.uint8, device=KERNEL_DEVICE)
    s = span_of(buf)
    with pytest.raises(MoverError, match="needs 4-byte aligned pointers"):
        copy_with_checksums(s.sub(2048, 100), s.sub(1, 100), 64)
    with pytest.raises(MoverError, match="chunk_bytes must be a positive multiple of 4, got 66"):
        copy_with_checksums(s.sub(2048, 100), s.sub(0, 100), 66)
    with pytest.raises(MoverError, match="overlap"):
        copy_with_checksums(s.sub(64, 128), s.sub(0, 128), 64)
    with pytest.raises(MoverError, match="a 2,048-byte source does not fit the 1,024-byte destination"):
        copy_with_checksums(s.sub(2048, 1024), s.sub(0, 2048), 64)


def test_copy_with_checksums_on_host_memory_without_kernels(monkeypatch):
    import flashboot.kernels.copy_verify as cv

    monkeypatch.setattr(cv, "interpreting", lambda: False)
    raw = random_bytes(10_001, seed=9)
    dst = np.zeros(10_001, np.uint8)
    found = cv.copy_with_checksums(dst, raw, 4096)
    assert np.array_equal(dst, raw) and found == ck.chunk_checksums_host(raw, 4096)


def test_flashboot_warm_writes_the_bytecode_and_runs_every_checksum_path(capsys, tmp_path, monkeypatch):
    import sys

    from flashboot.bytecode import sources
    from flashboot.cli import main

    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "pyc"))  # not the checkout's __pycache__
    assert main(["warm", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"bytecode of {len(sources())} modules written" in out
    assert "checksum (words path)" in out and "checksum (bytes path)" in out




@pytest.mark.gpu
def test_flashboot_warm_fills_tritons_cache_with_both_checksum_kernels(tmp_path):
    """Compiled ahead of time: a fresh process's first verified load then loads, not compiles
    (the word kernel's cubins in FlashBoot's cache, the byte kernel in Triton's)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FLASHBOOT_KERNEL_CACHE": str(tmp_path / "k")}
    p = subprocess.run([sys.executable, "-m", "flashboot.cli", "warm", "--device", "cuda:0"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    names = {f.name for f in (tmp_path / "triton").rglob("*")}
    assert any(n.startswith("checksum_words_kernel") for n in names)
    assert any(n.startswith("checksum_bytes_kernel") for n in names)
    entries = sorted(p.parent.name.rsplit("-", 3)[1] for p in (tmp_path / "k").glob("*/kernel.cubin"))
    assert entries == ["copy", "read"], entries
