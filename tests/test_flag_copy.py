"""The flag-driven chain copy: chunks copied as the predecessor's flags flip, flags raised for the
next clone, and a predecessor that never raises one ends in a clean timeout naming the chunk.

Runs the kernel on a GPU when there is one, else under TRITON_INTERPRET=1 on host memory
(programs run one after another there, so a stalled flag is found by counting polls)."""

import re

import numpy as np
import pytest
import torch

from flashboot import FlashBootError, MoverError, WaitTimeoutError
from flashboot._cuda import cuda_available
from flashboot.kernels.flag_copy import FlagChainCopy

DEVICE = "cuda" if cuda_available() else "cpu"
SMALL = dict(block_bytes=1024)  # several tiles per chunk under the interpreter
N, CHUNK = 64 * 1024, 8192
N_CHUNKS = N // CHUNK


def words(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (N // 4,), dtype=torch.int32, generator=g).to(DEVICE)


def flags(value=0):
    return torch.full((N_CHUNKS,), value, dtype=torch.int32, device=DEVICE)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("epoch", [1, 7, 0x7FFFFFFF, 0x80000001])
def test_chain_of_two_clones_copies_and_raises_every_flag(epoch):
    seed = words(epoch % 1000)
    c1, c2 = torch.zeros_like(seed), torch.zeros_like(seed)
    as_int32 = torch.tensor([epoch & 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).item()
    seed_flags, f1, f2 = flags(as_int32), flags(), flags()
    sync()
    FlagChainCopy(c1, seed, CHUNK, ready=seed_flags, done=f1, **SMALL).copy(epoch, stream=None, timeout_s=5)
    FlagChainCopy(c2, c1, CHUNK, ready=f1, done=f2, **SMALL).copy(epoch, stream=None, timeout_s=5)
    assert torch.equal(c1, seed) and torch.equal(c2, seed)
    assert f1.tolist() == [as_int32] * N_CHUNKS and f2.tolist() == [as_int32] * N_CHUNKS


def test_flag_ahead_of_the_epoch_counts_as_ready_and_behind_does_not():
    seed, dst = words(3), None
    dst = torch.zeros_like(seed)
    ready = flags(9)  # a later epoch already raised: GEQ lets it through
    ready[5] = 7  # an earlier epoch's flag: not ready for epoch 8
    sync()
    copier = FlagChainCopy(dst, seed, CHUNK, ready=ready, done=flags(), **SMALL)
    with pytest.raises(WaitTimeoutError, match=r"chunk 5 \(bytes 40,960..49,152\) of 8: its ready flag did not reach"):
        copier.copy(8, stream=None, timeout_s=0.5)
    assert torch.equal(dst[:5 * CHUNK // 4], seed[:5 * CHUNK // 4])


def test_predecessor_that_never_raises_a_flag_ends_in_a_timeout_naming_the_chunk():
    seed, dst, done = words(4), None, flags()
    dst = torch.zeros_like(seed)
    ready = flags(3)
    ready[2:] = 0  # the predecessor stopped after two chunks
    sync()
    with pytest.raises(WaitTimeoutError, match=r"chunk 2 \(bytes 16,384..24,576\) of 8"):
        FlagChainCopy(dst, seed, CHUNK, ready=ready, done=done, **SMALL).copy(3, stream=None, timeout_s=0.5)
    assert done.tolist() == [3, 3] + [0] * 6  # only whole chunks raise their flag
    assert torch.equal(dst[:2 * CHUNK // 4], seed[:2 * CHUNK // 4])


def test_bad_arguments_are_refused_with_the_numbers():
    seed, dst = words(5), None
    dst = torch.zeros_like(seed)
    with pytest.raises(MoverError, match=r"chunk_bytes a positive multiple of 16 \(got 1000\)"):
        FlagChainCopy(dst, seed, 1000, ready=flags(), done=flags())
    with pytest.raises(MoverError, match=r"the ready flags hold 4 int32 words .* 8 chunks need 8"):
        FlagChainCopy(dst, seed, CHUNK, ready=flags()[:4], done=flags())
    copier = FlagChainCopy(dst, seed, CHUNK, ready=flags(), done=flags())
    # NaN passed a "<= 0" check (on a GPU int(NaN * 1e9) raised a raw ValueError), inf overflowed
    for bad in (0, -1, float("nan"), float("inf"), 1e12, "5", True):
        with pytest.raises(MoverError, match=re.escape(f"flag chain copy: timeout_s must be a finite number of "
                                                       f"seconds in (0, 1e+06], got {bad!r}")):
            copier.launch(1, stream=None, timeout_s=bad)
    # before any launch the error word is 0: wait() reported "chunk 0 ... did not reach the epoch within 0 s"
    with pytest.raises(MoverError, match=re.escape("flag chain copy: wait() before launch(): nothing runs to wait for")):
        copier.wait()
    for bad in (1.5, "1", None, True):  # 1.5 raised a raw TypeError
        with pytest.raises(MoverError, match=re.escape(f"flag chain copy: epoch must be an int, got {bad!r}")):
            copier.launch(bad, stream=None, timeout_s=5)
    copier.launch(0, stream=None, timeout_s=5)  # flags of 0 are ready for epoch 0: it copies at once
    for bad in (float("nan"), -1, float("inf")):  # NaN: a GPU's wait for the kernel never ended
        with pytest.raises(MoverError, match=re.escape(f"flag chain copy: watchdog_s must be a finite number of "
                                                       f"seconds in (0, 1e+06], got {bad!r}")):
            copier.wait(watchdog_s=bad)


def test_overlapping_ranges_are_refused_and_a_numpy_chunk_size_taken():
    """A destination over its own source (one buffer, shifted by a chunk) copied wrong bytes
    without an error, and done flags inside the destination were overwritten by copied bytes
    (sm_copy, tma_copy and the movers refuse overlap); np.int64(CHUNK) was refused."""
    buf = torch.cat([words(11), words(12)])
    before = buf.clone()
    with pytest.raises(MoverError, match=r"the destination \(65,536 bytes at 0x[0-9a-f]+\) overlaps the source "
                                         r"\(65,536 bytes at 0x[0-9a-f]+\)"):
        FlagChainCopy(buf[CHUNK // 4:CHUNK // 4 + N // 4], buf[:N // 4], CHUNK, ready=flags(1), done=flags())
    dst = torch.zeros(N // 4 + N_CHUNKS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(MoverError, match=r"the destination .* overlaps the done flags \(32 bytes"):
        FlagChainCopy(dst[:N // 4], buf[:N // 4], CHUNK, ready=flags(1), done=dst[N // 4 - N_CHUNKS:N // 4])
    with pytest.raises(MoverError, match=r"the destination .* overlaps the ready flags"):
        FlagChainCopy(dst[:N // 4], buf[:N // 4], CHUNK, ready=dst[:N_CHUNKS], done=flags())
    with pytest.raises(MoverError, match=r"the done flags \(32 bytes at 0x[0-9a-f]+\) overlaps the source"):
        FlagChainCopy(dst[:N // 4], buf[:N // 4], CHUNK, ready=flags(1), done=buf[:N_CHUNKS])
    sync()
    assert torch.equal(buf, before)
    done = flags()
    FlagChainCopy(dst[:N // 4], buf[:N // 4], np.int64(CHUNK), ready=flags(1), done=done, **SMALL).copy(
        1, stream=None, timeout_s=5)
    assert torch.equal(dst[:N // 4], buf[:N // 4]) and done.tolist() == [1] * N_CHUNKS


def test_a_launch_after_the_arena_went_to_sleep_is_refused():
    """The copier keeps its spans from __init__: a launch after the arena's sleep() or close()
    ran the kernel on a range nothing backs (a segfault under the interpreter)."""
    from flashboot import Arena, ArenaError

    arena = Arena.create(1 << 20, DEVICE)  # refused before any launch, on either backend
    seed = words(7)
    copier = FlagChainCopy(arena.span(0, N), seed, CHUNK, ready=flags(1), done=flags(), **SMALL)
    arena.sleep()
    with pytest.raises(ArenaError, match=r"flag chain copy: the destination: .* which is asleep"):
        copier.launch(1, stream=None, timeout_s=5)
    arena.wake()
    copier.copy(1, stream=None, timeout_s=5)
    assert np.array_equal(arena.bytes()[:N].cpu().numpy(), seed.cpu().numpy().view(np.uint8))
    arena.close()
    with pytest.raises(ArenaError, match=r"flag chain copy: the destination: .* which is closed"):
        copier.launch(1, stream=None, timeout_s=5)


@pytest.mark.gpu
def test_gpu_chain_of_three_kernels_running_at_once():
    """seed -> c1 -> c2 with both clones' kernels resident together on two streams."""
    n = 64 << 20
    seed = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda")
    c1, c2 = torch.zeros_like(seed), torch.zeros_like(seed)
    chunk = 1 << 20
    ready = torch.full((n // chunk,), 1, dtype=torch.int32, device="cuda")
    f1, f2 = torch.zeros_like(ready), torch.zeros_like(ready)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    k1 = FlagChainCopy(c1, seed, chunk, ready=ready, done=f1)
    k2 = FlagChainCopy(c2, c1, chunk, ready=f1, done=f2)
    k2.launch(1, stream=s2, timeout_s=10)  # the downstream kernel first: it must wait on flags, not order
    k1.launch(1, stream=s1, timeout_s=10)
    k1.wait()
    k2.wait()
    assert torch.equal(c2, seed) and bool((f2 == 1).all())


@pytest.mark.two_gpus
def test_two_gpus_clone_reads_its_predecessor_over_p2p():
    """c1 on cuda:0 -> c2 on cuda:1: the kernel on cuda:1 polls c1's flags and reads its bytes."""
    n, chunk = 32 << 20, 1 << 20
    seed = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda:0")
    c1 = torch.zeros_like(seed)
    c2 = torch.zeros(n // 4, dtype=torch.int32, device="cuda:1")
    ready = torch.full((n // chunk,), 4, dtype=torch.int32, device="cuda:0")
    f1 = torch.zeros_like(ready)
    f2 = torch.zeros(n // chunk, dtype=torch.int32, device="cuda:1")
    for d in (0, 1):
        torch.cuda.synchronize(d)
    k2 = FlagChainCopy(c2, c1, chunk, ready=f1, done=f2)
    k1 = FlagChainCopy(c1, seed, chunk, ready=ready, done=f1)
    k2.launch(4, stream=torch.cuda.Stream(device=1), timeout_s=10)
    k1.launch(4, stream=torch.cuda.Stream(device=0), timeout_s=10)
    k1.wait()
    k2.wait()
    assert torch.equal(c2.cpu(), seed.cpu()) and bool((f2 == 4).all())


def test_tuning_knobs_are_checked_naming_the_knob():
    """A misspelt knob was ignored (block_byte=1024 ran with 32 KiB tiles) and a block that is not
    a power of two failed inside Triton's interpreter or compiler."""
    seed = words(6)
    dst = torch.zeros_like(seed)
    cases = [(dict(block_byte=1024), r"unknown tuning knob\(s\) \['block_byte'\]; known: \['block_bytes', 'num_warps', "
                                     r"'programs_per_sm'\]"),
             (dict(block_bytes=1000), r"block_bytes must be a power of two >= 16, got 1000"),
             (dict(block_bytes=True), r"block_bytes must be a power of two >= 16, got True"),
             (dict(num_warps=3), r"num_warps must be a power of two in 1..32, got 3"),
             (dict(programs_per_sm=0), r"programs_per_sm must be a positive int, got 0")]
    for tuning, message in cases:
        with pytest.raises(FlashBootError, match=message):
            FlagChainCopy(dst, seed, CHUNK, ready=flags(), done=flags(), **tuning)
