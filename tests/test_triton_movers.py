"""The triton_sm and triton_tma movers: registry facts, refusals, and real copies on GPUs."""

import pytest
import torch

from flashboot import CapabilityError, FlashBootError, MoverError
from flashboot._cuda import cuda_available
from flashboot.kernels.checksum import checksum
from flashboot.memory import span_of
from flashboot.movers import create_mover, list_movers, mover_class, movers_for

TRITON_MOVERS = ["triton_sm", "triton_tma"]


@pytest.mark.parametrize("name", TRITON_MOVERS)
def test_registered_with_paths(name):
    cls = mover_class(name)
    assert cls.name == name
    assert cls.paths == frozenset({"d2d", "p2p"})
    assert name in movers_for("d2d") and name in movers_for("p2p")
    assert name not in movers_for("h2d") and name not in movers_for("host")
    info = {i.name: i for i in list_movers()}[name]
    assert info.paths == ("d2d", "p2p")
    assert info.summary


@pytest.mark.skipif(cuda_available(), reason="checks the refusal on machines without CUDA")
def test_without_cuda_refuse_and_name_alternatives():
    ok, why = mover_class("triton_tma").availability()
    assert not ok and "no CUDA device" in why and "triton_sm" in why and "copy_engine" in why
    ok, why = mover_class("triton_sm").availability()
    assert not ok and "no CUDA device" in why
    for name in TRITON_MOVERS:
        with pytest.raises(CapabilityError, match=f"mover '{name}' cannot run here: no CUDA device"):
            create_mover(name)


def test_tma_refuses_when_triton_lacks_descriptors(monkeypatch):
    import flashboot._cuda as cu
    import flashboot.kernels.copy as kc

    monkeypatch.setattr(cu, "cuda_available", lambda: True)
    monkeypatch.delattr(kc.tl, "make_tensor_descriptor")
    ok, why = mover_class("triton_tma").availability()
    assert not ok
    assert "lacks tl.make_tensor_descriptor" in why and "triton_sm" in why and "copy_engine" in why


# ------------------------------------------------------------------------------------ real GPU
def _pair(nbytes, src_dev="cuda:0", dst_dev="cuda:0", src_off=0, dst_off=0):
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, device=src_dev)
    dst = torch.full((nbytes + 64,), 0x5A, dtype=torch.uint8, device=dst_dev)
    for dev in {src_dev, dst_dev}:  # filled on default streams; the movers run on others
        torch.cuda.synchronize(dev)
    return src, dst, span_of(src).sub(src_off, nbytes), span_of(dst).sub(dst_off, nbytes)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON_MOVERS)
def test_gpu_d2d_copy_verified_by_checksum(name):
    mover = create_mover(name)
    nbytes = (32 << 20) + 7
    src, dst, s, d = _pair(nbytes, src_off=16, dst_off=32)
    stream = torch.cuda.Stream(device=0)
    mover.copy(d, s, stream=stream)
    stream.synchronize()
    assert checksum(d) == checksum(s)
    assert torch.equal(dst[32:32 + nbytes], src[16:16 + nbytes])
    assert (dst[:32] == 0x5A).all() and (dst[32 + nbytes:] == 0x5A).all()


@pytest.mark.gpu
def test_gpu_sm_any_alignment_tma_refuses_incongruent():
    src, dst, s, d = _pair(1 << 20, src_off=1, dst_off=6)
    create_mover("triton_sm").copy(d, s, stream=None)
    torch.cuda.synchronize()
    assert torch.equal(dst[6:6 + (1 << 20)], src[1:1 + (1 << 20)])
    with pytest.raises(MoverError, match="mod 16 bytes"):
        create_mover("triton_tma").copy(d, s, stream=None)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TRITON_MOVERS)
def test_gpu_refuses_host_paths_and_checks_tuning(name):
    mover = create_mover(name)
    host = torch.zeros(64, dtype=torch.uint8)
    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(MoverError, match="cannot copy h2d"):
        mover.copy(dev, host, stream=None)
    with pytest.raises(FlashBootError, match="unknown tuning knob"):
        create_mover(name, no_such_knob=1)
    tuned = create_mover(name, block_bytes=16384, num_warps=8)
    assert tuned.tuning["block_bytes"] == 16384 and tuned.tuning["num_warps"] == 8


ALL_D2D = ["copy_engine", "triton_sm", "triton_tma"]


# TMA takes 16-byte aligned chunks only (its refusal of others is tested on the host), so it runs
# the aligned case alone rather than a skipped unaligned one.
@pytest.mark.gpu
@pytest.mark.parametrize("name,aligned", [(n, a) for n in ALL_D2D for a in (True, False)
                                          if a or n != "triton_tma"])
def test_gpu_batch_and_per_chunk_copies_are_exact(name, aligned):
    """One batched call and one call per chunk, over many chunks of assorted sizes: every chunk's
    bytes land, nothing else is written (chunks 16-byte aligned for TMA, any offsets otherwise)."""
    mover = create_mover(name)
    total = 24 << 20
    src, dst, s, d = _pair(total)
    g = torch.Generator().manual_seed(len(name) + aligned)
    sizes = torch.randint(1, 1 << 18, (64,), generator=g).tolist()
    chunks, off = [], 0
    for i, n in enumerate(sizes):
        n = (n + 15) // 16 * 16 if aligned else n + (i % 3)
        gap = 16 if aligned else 1 + i % 5
        chunks.append((off, total - off - n, n))  # reversed placement: sources from the far end
        off += n + gap
    for mode in ("batched", "per_chunk"):
        dst.fill_(0x5A)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream(device=0)
        batch = mover.batch(d, s, chunks)
        if mode == "batched":
            batch.run(stream=stream)
        else:
            for i in range(len(batch)):
                batch.copy_chunk(i, stream=stream)
        stream.synchronize()
        expect = torch.full_like(dst, 0x5A)
        for do, so, n in chunks:
            expect[do:do + n] = src[so:so + n]
        assert torch.equal(dst, expect), (name, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [2, 4])
def test_gpu_copy_engine_batch_on_several_streams_keeps_the_callers_order(streams):
    """A batch spread over side streams starts after what the caller's stream queued before it
    (a fill held back by a sleep) and ends before what it queues after (a read-back)."""
    mover = create_mover("copy_engine", batch_streams=streams)
    total = 64 << 20
    src, dst, s, d = _pair(total)
    chunks = [(o, o, 1 << 20) for o in range(0, total, 1 << 20)]
    batch = mover.batch(d, s, chunks)
    stream = torch.cuda.Stream(device=0)
    out = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # ~30 ms: the side streams would copy the old bytes without the fork
        src[:total].fill_(0x3C)
    batch.run(stream=stream)
    with torch.cuda.stream(stream):
        out.copy_(dst[:total])  # would read half-copied bytes without the join
    stream.synchronize()
    assert bool((out == 0x3C).all()) and bool((dst[total:] == 0x5A).all())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL_D2D)
def test_gpu_repeated_small_copies_stay_exact(name):
    """The cached launch path: thousands of copies at shifting offsets after the first compiles."""
    mover = create_mover(name)
    src, dst, s, d = _pair(1 << 20)
    stream = torch.cuda.Stream(device=0)
    offsets = [(i * 4099) % ((1 << 20) - 8192) for i in range(2000)]
    for o in offsets:
        o = o // 16 * 16 if name == "triton_tma" else o
        mover.copy(d.sub(o, 4096), s.sub(o, 4096), stream=stream)
    stream.synchronize()
    touched = torch.zeros(1 << 20, dtype=torch.bool, device="cuda")
    for o in offsets:
        o = o // 16 * 16 if name == "triton_tma" else o
        touched[o:o + 4096] = True
    got, want = dst[:1 << 20], src[:1 << 20]
    assert torch.equal(got[touched], want[touched]) and bool((got[~touched] == 0x5A).all())


@pytest.mark.gpu
def test_gpu_tma_available_on_hopper():
    major, _ = torch.cuda.get_device_capability(0)
    ok, why = mover_class("triton_tma").availability()
    assert ok == (major >= 9), why


@pytest.mark.two_gpus
@pytest.mark.parametrize("name", TRITON_MOVERS)
def test_p2p_copy_verified_by_checksum(name):
    mover = create_mover(name)
    nbytes = (256 << 20) + 3
    src, dst, s, d = _pair(nbytes, "cuda:0", "cuda:1")
    stream = torch.cuda.Stream(device=1)
    mover.copy(d, s, stream=stream)
    stream.synchronize()
    assert checksum(d) == checksum(s)
    assert torch.equal(dst[:nbytes].cpu(), src[:nbytes].cpu())


def test_p2p_without_peer_access_names_the_alternative(monkeypatch):
    import cupy

    from flashboot.memory import Device, Span
    from flashboot.movers import triton_sm

    monkeypatch.setattr(cupy.cuda.runtime, "deviceCanAccessPeer", lambda reader, owner: 0)
    src = Span(0x7F0000000000, 4096, Device("cuda", 5))
    with pytest.raises(CapabilityError, match=r"cuda:7 cannot access memory of cuda:5.*'copy_engine'"):
        triton_sm.ensure_peer_access(7, src)
    assert (7, 5) not in triton_sm._peer_enabled
