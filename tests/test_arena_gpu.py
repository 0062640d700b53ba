"""The CUDA arena and the copy_engine mover on real GPUs: VMM create and views, export/open in a
second process on the same GPU and on a peer GPU, byte-exact copies on every path, admission,
transactional setup, fabric preflight, and GPU memory back at its starting level.

Every test here needs a CUDA device (``gpu``); the peer tests need two (``two_gpus``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import flashboot.arena as arena_mod
import flashboot.arena.backing_cuda as cuda_backing
from flashboot import Arena, ArenaDescriptor, ArenaError, CapabilityError, Device, OutOfMemoryError
from flashboot._cuda import check, device_count, driver, use_device

pytestmark = pytest.mark.gpu

MiB, GiB = 1 << 20, 1 << 30
LEAK_TOLERANCE = 64 * MiB
"""Allowed drift of cuMemGetInfo between before and after (lazy module loading, driver pools);
far below the smallest arena these tests leak-check (512 MiB)."""


def gpu_free(index: int) -> int:
    use_device(index)
    free, _total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def expected_int64(nelem: int, seed: int, device):
    import torch

    return torch.arange(nelem, dtype=torch.int64, device=device) * 1_000_003 + seed


def host_pattern(nbytes: int, seed: int):
    import torch

    data = torch.from_numpy(((np.arange(nbytes, dtype=np.uint64) * 131 + seed) % 253).astype(np.uint8))
    return data.pin_memory()


# ---------------------------------------------------------------------------------------------
# A second process: opens, creates, fills and checks CUDA arenas on request (JSON lines).
# ---------------------------------------------------------------------------------------------

CHILD_SRC = textwrap.dedent(
    """
    import json, sys
    import torch
    from flashboot import Arena, ArenaDescriptor

    def expected(nelem, seed, device):
        return torch.arange(nelem, dtype=torch.int64, device=device) * 1_000_003 + seed

    arenas = {}
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "open":
                a = Arena.open(ArenaDescriptor.from_dict(req["descriptor"]), req["device"])
                arenas[req["name"]] = a
                out = {"device": str(a.device), "home": str(a.home_device), "imported": a.imported, "nbytes": a.nbytes}
            elif op == "create":
                a = Arena.create(req["nbytes"], req["device"])
                arenas[req["name"]] = a
                out = {"descriptor": a.export().to_dict()}
            elif op == "fill":
                a = arenas[req["name"]]
                a.view(req["offset"], req["nelem"], "int64").copy_(expected(req["nelem"], req["seed"], f"cuda:{a.device.index}"))
                torch.cuda.synchronize(a.device.index)
                out = {}
            elif op == "check":
                a = arenas[req["name"]]
                v = a.view(req["offset"], req["nelem"], "int64")
                out = {"equal": bool(torch.equal(v, expected(req["nelem"], req["seed"], v.device)))}
            elif op == "close":
                arenas.pop(req["name"]).close()
                out = {}
            elif op == "exit":
                break
            else:
                raise ValueError(op)
            out["ok"] = True
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    """
)


class Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD_SRC], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait(timeout=60)} during {op!r}"
        reply = json.loads(line)
        assert reply.pop("ok"), f"child failed {op!r}: {reply.get('error')}"
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.stop()


# ---------------------------------------------------------------------------------------------
# Create and views
# ---------------------------------------------------------------------------------------------


def test_create_1gb_and_views_write_read():
    import torch

    with Arena.create(GiB + 1, 0) as a:
        assert a.requested_nbytes == GiB + 1
        assert a.nbytes % a.granularity == 0 and GiB + 1 <= a.nbytes < GiB + 1 + a.granularity
        assert a.device == Device("cuda", 0) == a.home_device and not a.imported
        assert a.handle_type in ("posix_fd", "fabric+posix_fd")
        flat = a.bytes()
        assert flat.device == torch.device("cuda", 0) and flat.dtype == torch.uint8
        assert flat.data_ptr() == a.ptr and flat.numel() == a.nbytes

        n = (GiB // 8) - 16
        a.view(64, n, "int64").copy_(expected_int64(n, 7, "cuda:0"))
        torch.cuda.synchronize(0)
        assert torch.equal(a.view(64, n, torch.int64), expected_int64(n, 7, "cuda:0"))

        w = a.view(256 * MiB, (1024, 1024), "bfloat16")
        ref = torch.randn(1024, 1024, dtype=torch.bfloat16)
        w.copy_(ref.to("cuda:0"))
        assert torch.equal(a.view(256 * MiB, (1024, 1024), "int16").cpu(), ref.view(torch.int16))

        s = a.view(64, (3, 4), "int64", stride=(10, 2))
        assert s.cpu().tolist() == [[(10 * i + 2 * j) * 1_000_003 + 7 for j in range(4)] for i in range(3)]

        with pytest.raises(ArenaError, match=rf"past the arena's {a.nbytes:,} bytes"):
            a.view(a.nbytes - 4, 2, "float32")
        with pytest.raises(ArenaError, match="not aligned for torch.float32"):
            a.view(6, 2, "float32")


def test_nonexistent_device_and_oom_are_refused_before_allocating():
    n = device_count()
    with pytest.raises(CapabilityError, match=f"has {n} CUDA device"):
        Arena.create(MiB, n)
    free = gpu_free(0)
    _, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
    with pytest.raises(OutOfMemoryError, match=r"arena on cuda:0: needs [\d,]+ bytes but only [\d,]+ are free") as err:
        Arena.create(2 * int(total), 0)
    assert err.value.nbytes_needed >= 2 * int(total) > err.value.nbytes_free
    assert abs(gpu_free(0) - free) < LEAK_TOLERANCE


def test_fabric_preflight_reports_a_clear_fallback():
    support = arena_mod.fabric_preflight(0)
    assert arena_mod.preflight_handle(0, "posix_fd").supported
    with Arena.create(4 * MiB, 0) as a:
        d = a.export()
        if support.supported:
            assert a.handle_type == d.handle_type == "fabric+posix_fd"
            assert len(d.fabric_handles) == d.segments and all(len(h) == 64 for h in d.fabric_handles)
        else:
            # On machines without an IMEX channel: CUDA_ERROR_NOT_PERMITTED from the preflight cuMemCreate.
            assert "CUDA_ERROR_" in support.reason or "= 0" in support.reason, support.reason
            assert a.handle_type == d.handle_type == "posix_fd" and d.fabric_handles is None
        assert arena_mod.fabric_preflight(0) is support  # cached


def test_gpu_memory_back_to_start_after_create_export_open_close_cycles():
    import torch

    def cycle():
        a = Arena.create(512 * MiB, 0)
        a.view(0, 1024, "int64").fill_(3)
        a.export()
        b = Arena.open(a.export(), 0)  # an importer in the same process
        assert int(b.view(0, 1024, "int64").sum()) == 3 * 1024
        b.close()
        a.close()

    cycle()  # warm-up: kernels load lazily and take device memory once
    torch.cuda.synchronize(0)
    before = gpu_free(0)
    for _ in range(4):
        cycle()
    torch.cuda.synchronize(0)
    assert abs(gpu_free(0) - before) < LEAK_TOLERANCE


def test_failure_halfway_releases_handle_and_reservation(monkeypatch):
    before = gpu_free(0)

    def broken(ptr, nbytes, devices):
        raise CapabilityError("injected failure in cuMemSetAccess")

    monkeypatch.setattr(cuda_backing, "_set_access", broken)
    for _ in range(3):
        with pytest.raises(CapabilityError, match="injected failure"):
            Arena.create(GiB, 0)
    monkeypatch.undo()
    assert abs(gpu_free(0) - before) < LEAK_TOLERANCE
    with Arena.create(GiB, 0) as a:  # and the device still works
        a.view(0, 8, "int64").fill_(1)
        assert int(a.view(0, 8, "int64").sum()) == 8


def test_an_arena_made_with_segments_now_makes_the_rest_on_first_need_and_frees_all_at_close():
    """CUDA ``segments_now``: the first segments at once (device memory taken for those only), each
    other one made (created, mapped, granted) when an export, a view or bytes() needs it; an
    importer sees every byte; close frees all, whether every segment was made or not."""
    import torch

    seg = 64 * MiB
    torch.cuda.synchronize(0)
    before = gpu_free(0)
    a = Arena.create(8 * seg, 0, segment_bytes=seg, segments_now=2)
    assert a.mapped_nbytes == 2 * seg and before - gpu_free(0) < 2 * seg + LEAK_TOLERANCE
    assert len(a.export_segments(0, 4)) == 4 and a.mapped_nbytes == 4 * seg
    n = a.nbytes // 8
    a.bytes().view(torch.int64).copy_(expected_int64(n, 5, "cuda:0"))  # every segment, the rest made now
    torch.cuda.synchronize(0)
    assert a.mapped_nbytes == a.nbytes
    with Arena.open(a.export(), 0) as b:
        assert torch.equal(b.bytes().view(torch.int64), expected_int64(n, 5, "cuda:0"))
    a.close()
    c = Arena.create(8 * seg, 0, segment_bytes=seg, segments_now=1)
    c.export_segments(0, 3)
    c.close()  # three of eight made
    torch.cuda.synchronize(0)
    assert abs(gpu_free(0) - before) < LEAK_TOLERANCE


def test_a_view_held_past_close_reads_its_bytes_and_the_last_view_frees_the_gpu_memory():
    """A model's parameter still bound to a closed arena read unmapped device memory: an illegal
    address, which ends the process's CUDA context. The memory now goes with the last view."""
    import torch

    seg = 256 * MiB
    torch.cuda.synchronize(0)
    before = gpu_free(0)
    a = Arena.create(4 * seg, 0, segment_bytes=seg)
    n = seg // 8
    weight = a.view(2 * seg, (n,), torch.int64)
    weight.copy_(expected_int64(n, 9, "cuda:0"))
    with pytest.warns(ResourceWarning, match=f"arena {a.arena_id} closed while views of it are still held"):
        a.close(keep_viewed=True)
    assert torch.equal(weight, expected_int64(n, 9, "cuda:0"))  # still mapped, still its bytes
    torch.cuda.synchronize(0)
    assert before - gpu_free(0) >= 4 * seg - LEAK_TOLERANCE
    del weight
    torch.cuda.synchronize(0)
    assert abs(gpu_free(0) - before) < LEAK_TOLERANCE
    b = Arena.create(4 * seg, 0, segment_bytes=seg)  # no view held: close frees at once, no warning
    b.view(0, (8,), torch.int64).fill_(1)
    torch.cuda.synchronize(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        b.close(keep_viewed=True)
    assert abs(gpu_free(0) - before) < LEAK_TOLERANCE


def test_later_segments_that_cannot_be_granted_are_released_and_a_retry_works(monkeypatch):
    """A call that makes an arena's later segments and fails (here its grant) unmaps and frees
    what it made: the device memory comes back, and the next need makes them again, usable."""
    import torch

    seg = 64 * MiB
    torch.cuda.synchronize(0)
    with Arena.create(6 * seg, 0, segment_bytes=seg, segments_now=1) as a:
        after_first = gpu_free(0)

        def broken(ptr, nbytes, devices):
            raise CapabilityError("injected failure in cuMemSetAccess")

        monkeypatch.setattr(cuda_backing, "_set_access", broken)
        with pytest.raises(CapabilityError, match="injected failure"):
            a.export_segments(0, 4)
        monkeypatch.undo()
        assert a.mapped_nbytes == seg and abs(gpu_free(0) - after_first) < LEAK_TOLERANCE
        n = a.nbytes // 8
        a.bytes().view(torch.int64).copy_(expected_int64(n, 9, "cuda:0"))
        torch.cuda.synchronize(0)
        assert torch.equal(a.bytes().view(torch.int64), expected_int64(n, 9, "cuda:0"))


def test_close_twice_and_wrong_fd():
    a = Arena.create(4 * MiB, 0)
    d = a.export()
    r, w = os.pipe()
    try:
        with pytest.raises(ArenaError, match=rf"fd {r} of pid {os.getpid()} .* is not the CUDA memory handle"):
            Arena.open(dataclasses.replace(d, fds=(r,)), 0)
    finally:
        os.close(r)
        os.close(w)
    a.close()
    with pytest.raises(ArenaError, match="already closed"):
        a.close()
    with pytest.raises(ArenaError, match=rf"pid {os.getpid()}"):
        Arena.open(d, 0)  # the exported fd was closed with the arena


# ---------------------------------------------------------------------------------------------
# Across processes
# ---------------------------------------------------------------------------------------------


def test_open_in_child_on_same_gpu(child):
    import torch

    with Arena.create(256 * MiB, 0) as a:
        n = 16 * MiB
        a.view(0, n, "int64").copy_(expected_int64(n, 1, "cuda:0"))
        torch.cuda.synchronize(0)
        reply = child("open", name="same", descriptor=a.export().to_dict(), device=0)
        assert reply == {"device": "cuda:0", "home": "cuda:0", "imported": True, "nbytes": a.nbytes}
        assert child("check", name="same", offset=0, nelem=n, seed=1)["equal"]
        assert not child("check", name="same", offset=0, nelem=n, seed=2)["equal"]
        child("fill", name="same", offset=128 * MiB, nelem=n, seed=3)
        assert torch.equal(a.view(128 * MiB, n, "int64"), expected_int64(n, 3, "cuda:0"))
        child("close", name="same")
        assert torch.equal(a.view(0, n, "int64"), expected_int64(n, 1, "cuda:0"))  # importer close freed nothing


def test_parent_opens_child_arena_and_exited_exporter_is_named(child):
    import torch

    d = ArenaDescriptor.from_dict(child("create", name="c", nbytes=64 * MiB, device=0)["descriptor"])
    assert d.backend == "cuda" and d.pid == child.proc.pid and d.device_index == 0
    child("fill", name="c", offset=0, nelem=MiB, seed=5)
    with Arena.open(d, 0) as b:
        assert torch.equal(b.view(0, MiB, "int64"), expected_int64(MiB, 5, "cuda:0"))
    child("close", name="c")

    src = ("import json; from flashboot import Arena; a = Arena.create(1 << 24, 0); "
           "print(json.dumps(a.export().to_dict()))")
    out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=300, check=True)
    gone = ArenaDescriptor.from_dict(json.loads(out.stdout.strip().splitlines()[-1]))
    with pytest.raises(ArenaError, match=rf"pid {gone.pid}: process {gone.pid} has exited"):
        Arena.open(gone, 0)


@pytest.mark.two_gpus
def test_open_in_child_on_the_peer_gpu(child):
    import torch

    with Arena.create(256 * MiB, 0) as a:
        n = 16 * MiB
        a.view(0, n, "int64").copy_(expected_int64(n, 11, "cuda:0"))
        torch.cuda.synchronize(0)
        reply = child("open", name="peer", descriptor=a.export().to_dict(), device=1)
        assert reply == {"device": "cuda:1", "home": "cuda:0", "imported": True, "nbytes": a.nbytes}
        assert child("check", name="peer", offset=0, nelem=n, seed=11)["equal"]  # GPU1 reads GPU0 memory
        child("fill", name="peer", offset=64 * MiB, nelem=n, seed=12)  # and writes it
        assert torch.equal(a.view(64 * MiB, n, "int64"), expected_int64(n, 12, "cuda:0"))
        child("close", name="peer")


# ---------------------------------------------------------------------------------------------
# copy_engine, byte for byte
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 4097, 64 * MiB + 3])
def test_copy_engine_h2d_d2h_d2d(nbytes):
    import torch
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    src = host_pattern(nbytes, nbytes % 251)
    back = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream(device=0)
    with Arena.create(256 * MiB, 0) as a, Arena.create(128 * MiB, 0) as b:
        mover.copy(a.span(5, nbytes), src, stream=stream)  # h2d at an odd offset
        mover.copy(b.span(3, nbytes), a.span(5, nbytes), stream=stream)  # d2d between arenas
        mover.copy(a.span(100 * MiB + 1, nbytes), b.span(3, nbytes), stream=stream)  # d2d inside one arena
        mover.copy(back, a.span(100 * MiB + 1, nbytes), stream=stream)  # d2h
        stream.synchronize()
        assert torch.equal(back, src)
        assert int(a.bytes()[:5].sum()) == 0 and int(b.bytes()[:3].sum()) == 0


def test_copy_engine_on_default_stream_with_tensors():
    import torch
    from flashboot.movers import create_mover

    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda:0")
    dst = torch.empty_like(src)
    create_mover("copy_engine").copy(dst, src, stream=None)
    torch.cuda.synchronize(0)
    assert torch.equal(dst, src)


@pytest.mark.two_gpus
@pytest.mark.parametrize("nbytes", [4097, 64 * MiB + 3])
def test_copy_engine_p2p(nbytes):
    import torch
    from flashboot.movers import create_mover

    mover = create_mover("copy_engine")
    src = host_pattern(nbytes, 17)
    back = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    with Arena.create(256 * MiB, 0, access="all") as a0, Arena.create(128 * MiB, 1, access="all") as a1:
        s0, s1 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
        mover.copy(a0.span(1, nbytes), src, stream=s0)
        s0.synchronize()
        mover.copy(a1.span(7, nbytes), a0.span(1, nbytes), stream=s1)  # p2p GPU0 -> GPU1
        s1.synchronize()
        mover.copy(a0.span(64 * MiB, nbytes), a1.span(7, nbytes), stream=s0)  # p2p GPU1 -> GPU0
        mover.copy(back, a0.span(64 * MiB, nbytes), stream=s0)
        s0.synchronize()
        assert torch.equal(back, src)


@pytest.mark.two_gpus
def test_access_all_grants_the_peer():
    assert arena_mod._resolve_access(0, "all") == [0] + [i for i in range(1, device_count()) if arena_mod.can_access_peer(i, 0)]
    assert arena_mod._resolve_access(0, [1]) == [0, 1]


@pytest.mark.two_gpus
def test_peer_open_maps_segments_on_first_use_byte_exact():
    import torch

    from flashboot.memory import span_of
    from flashboot.movers import create_mover

    with Arena.create(GiB + 3 * MiB, 0) as a:
        assert (a.segments, a.segment_bytes) == (5, arena_mod.SEGMENT_BYTES)
        n = a.nbytes // 8
        a.view(0, n, "int64").copy_(expected_int64(n, 7, "cuda:0"))
        torch.cuda.synchronize(0)
        timings: dict = {}
        with Arena.open(a.export(), 1, timings=timings) as b:
            assert b.mapped_nbytes == 256 * MiB and timings["set_access_ms"] > 0
            k = 256 * MiB // 8
            straddle = b.view((k - 4) * 8, (8,), "int64")  # the last 4 of segment 0, the first 4 of segment 1
            assert b.mapped_nbytes == 512 * MiB
            assert torch.equal(straddle.cpu(), expected_int64(n, 7, "cpu")[k - 4:k + 4])
            dst = torch.empty(a.nbytes, dtype=torch.uint8, device="cuda:1")
            create_mover("copy_engine").copy(span_of(dst), b.span(), stream=None)  # maps the other three
            torch.cuda.synchronize(1)
            assert b.mapped_nbytes == b.nbytes and b.map_stats["segments"] == 4
            assert torch.equal(dst.view(torch.int64), expected_int64(n, 7, "cuda:1"))


@pytest.mark.two_gpus
def test_library_calls_leave_the_callers_current_device_alone():
    import torch

    from flashboot.arena import release_warm_imports, warm_import

    for mine, other in ((0, 1), (1, 0)):
        torch.cuda.set_device(mine)
        with Arena.create(300 * MiB, other) as a:  # two segments
            assert torch.cuda.current_device() == mine
            a.export()
            assert torch.cuda.current_device() == mine
            with Arena.open(a.export(), mine) as b:
                assert torch.cuda.current_device() == mine
                b.span(256 * MiB, MiB)  # maps the second segment on first use
                assert torch.cuda.current_device() == mine and b.mapped_nbytes == b.nbytes
            assert torch.cuda.current_device() == mine
        assert torch.cuda.current_device() == mine
        warm_import(f"cuda:{other}")
        release_warm_imports()
        assert torch.cuda.current_device() == mine
    torch.cuda.set_device(0)


def test_info_command_reports_devices_and_handle_types(capsys):
    from flashboot.cli import main

    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda"]["device_count"] == device_count() == len(info["devices"])
    d0 = info["devices"][0]
    assert d0["vmm"] and d0["handle_types"]["posix_fd"]["supported"]
    assert d0["handle_types"]["fabric"]["supported"] == arena_mod.fabric_preflight(0).supported
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    assert "cuda:0" in text and "handle posix_fd  works" in text and "copy_engine" in text
