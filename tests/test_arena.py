"""Arena on the host backend (memfd): create, views, export/open across real processes, bad input,
transactional setup and leaks. Runs on any Linux machine; the CUDA backend is in test_arena_gpu.py."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import flashboot.arena.backing_host as host_backing
from flashboot import Arena, ArenaDescriptor, ArenaError, Device, FlashBootError, OutOfMemoryError
from flashboot import RendezvousError, WaitTimeoutError
from flashboot._cuda import cuda_available
from flashboot.arena import HOST_GRANULARITY, SEGMENT_BYTES, _Undo
from flashboot.fdshare import SCM_MAX_FD, pidfd_getfd, recv_fd, send_fd, send_fds

MiB = 1 << 20


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic bytes that differ per position and per seed."""
    return ((np.arange(nbytes, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def open_fds() -> dict[str, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the directory fd listdir itself used
            pass
    return out


def arena_fds() -> list[str]:
    return sorted(t for t in open_fds().values() if "flashboot-arena" in t)


def arena_maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if "flashboot-arena" in line]


# ---------------------------------------------------------------------------------------------
# A second process that runs arena operations sent as JSON lines on stdin.
# ---------------------------------------------------------------------------------------------

CHILD_SRC = textwrap.dedent(
    """
    import json, os, socket, sys
    import numpy as np
    from flashboot import Arena, ArenaDescriptor
    from flashboot.fdshare import recv_fds, recv_more_fds

    def pattern(nbytes, seed):
        return ((np.arange(nbytes, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)

    arenas = {}
    sock = socket.socket(fileno=int(sys.argv[1])) if len(sys.argv) > 1 else None
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "open":
                a = Arena.open(ArenaDescriptor.from_dict(req["descriptor"]), "cpu")
                arenas[req["name"]] = a
                out = {"nbytes": a.nbytes, "imported": a.imported}
            elif op == "open_socket":
                fds, msg = recv_fds(sock, 253, timeout_s=30)
                d = ArenaDescriptor.from_dict(json.loads(msg))
                try:
                    a = Arena.open(d, "cpu", fds=recv_more_fds(sock, fds, d.segments, timeout_s=30))
                finally:
                    for fd in fds:
                        os.close(fd)
                arenas[req["name"]] = a
                out = {"nbytes": a.nbytes}
            elif op == "create":
                a = Arena.create(req["nbytes"], "cpu", segment_bytes=req.get("segment_bytes"))
                arenas[req["name"]] = a
                out = {"descriptor": a.export().to_dict()}
            elif op == "write":
                a = arenas[req["name"]]
                a.bytes()[req["offset"]:req["offset"] + req["nbytes"]].numpy()[:] = pattern(req["nbytes"], req["seed"])
                out = {}
            elif op == "check":
                a = arenas[req["name"]]
                got = a.bytes()[req["offset"]:req["offset"] + req["nbytes"]].numpy()
                out = {"equal": bool(np.array_equal(got, pattern(req["nbytes"], req["seed"])))}
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
    """A Python process that opens, writes and checks arenas on request."""

    def __init__(self, sock_fd: int | None = None):
        args = [sys.executable, "-c", CHILD_SRC] + ([str(sock_fd)] if sock_fd is not None else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     pass_fds=(sock_fd,) if sock_fd is not None else ())

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"child exited with {self.proc.wait(timeout=30)} during {op!r}"
        reply = json.loads(line)
        assert reply.pop("ok"), f"child failed {op!r}: {reply.get('error')}"
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def child():
    """One child for the module; ``child.sock`` is the parent's end of a Unix socket pair with it."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c = Child(child_sock.fileno())
    child_sock.close()
    c.sock = parent_sock
    yield c
    c.stop()
    parent_sock.close()


# ---------------------------------------------------------------------------------------------
# Create, attributes, views
# ---------------------------------------------------------------------------------------------


def test_create_rounds_capacity_to_granularity():
    with Arena.create(5 * MiB + 1, "cpu") as a:
        assert a.requested_nbytes == 5 * MiB + 1
        assert a.granularity == HOST_GRANULARITY == 2 * MiB
        assert a.nbytes == 6 * MiB
        assert a.device == Device("cpu") and a.home_device == Device("cpu")
        assert a.handle_type == "memfd" and not a.imported
        assert a.bytes().shape == (6 * MiB,) and a.bytes().dtype == torch.uint8
        assert a.bytes().data_ptr() == a.ptr
        assert len(a.arena_id) == 16


def test_default_device_follows_cuda_availability():
    with Arena.create(MiB) as a:
        assert a.device == (Device("cuda", 0) if cuda_available() else Device("cpu"))


def test_fresh_arena_reads_zero_and_bytes_is_zero_copy():
    with Arena.create(3 * MiB, "cpu") as a:
        flat = a.bytes()
        assert int(flat.sum()) == 0
        flat[100:110] = 7
        assert a.view(100, 10, torch.uint8).tolist() == [7] * 10


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "torch.float16", torch.int64, "int8", "float64"])
def test_view_dtypes_share_the_arena_bytes(dtype):
    with Arena.create(MiB, "cpu") as a:
        t = a.view(4096, (16, 8), dtype)
        assert t.shape == (16, 8) and t.data_ptr() == a.ptr + 4096
        t.copy_(torch.arange(128).reshape(16, 8).to(t.dtype))
        raw = a.bytes()[4096:4096 + t.numel() * t.element_size()].clone()
        assert torch.equal(raw.view(t.dtype).reshape(16, 8), torch.arange(128).reshape(16, 8).to(t.dtype))
        assert int(a.bytes()[:4096].sum()) == 0  # nothing written before the view


def test_strided_view_matches_numpy_indexing():
    with Arena.create(MiB, "cpu") as a:
        a.view(0, 1024, "int32").copy_(torch.arange(1024, dtype=torch.int32))
        t = a.view(64, (3, 4), "int32", stride=(10, 2))  # element offset 16
        expected = np.array([[16 + 10 * i + 2 * j for j in range(4)] for i in range(3)], dtype=np.int32)
        assert np.array_equal(t.numpy(), expected)
        t[1, 1] = -5  # writes land in the arena
        assert int(a.view(0, 1024, "int32")[16 + 10 + 2]) == -5


def test_view_ending_exactly_at_capacity_is_allowed():
    with Arena.create(MiB, "cpu") as a:
        n = a.nbytes
        t = a.view(n - 8, 2, "float32")
        assert t.data_ptr() + 8 == a.ptr + n
        assert a.view(n, 0, "float32").numel() == 0


def test_view_out_of_bounds_names_offset_extent_and_capacity():
    with Arena.create(MiB, "cpu") as a:
        n = a.nbytes
        with pytest.raises(ArenaError, match=rf"view of 16 bytes at offset {n - 8:,} ends at {n + 8:,}, past the arena's {n:,} bytes"):
            a.view(n - 8, 4, "float32")
        with pytest.raises(ArenaError, match=r"ends at"):
            a.view(0, (2, 4), "float64", stride=(n // 8, 1))


def test_view_misaligned_offset_names_item_size():
    with Arena.create(MiB, "cpu") as a:
        with pytest.raises(ArenaError, match=r"offset 2 is not aligned for torch.float32 \(item size 4 bytes\)"):
            a.view(2, 4, "float32")
        assert a.view(2, 4, "bfloat16").shape == (4,)


@pytest.mark.parametrize(
    "offset, shape, dtype, stride, message",
    [
        (-8, 4, "float32", None, "offset must be a non-negative int"),
        (0, (2, -1), "float32", None, "shape must be non-negative ints"),
        (0, (2, 2), "float32", (2, -1), "strides must be non-negative"),
        (0, (2, 2), "float32", (2,), "has 1 dims, shape"),
        (0, 4, "floaty", None, "unknown dtype 'floaty'"),
        (0, 4, "Tensor", None, "unknown dtype 'Tensor'"),
    ],
)
def test_view_bad_arguments(offset, shape, dtype, stride, message):
    with Arena.create(MiB, "cpu") as a:
        with pytest.raises(ArenaError, match=message):
            a.view(offset, shape, dtype, stride)


def test_span_bounds():
    with Arena.create(MiB, "cpu") as a:
        s = a.span(4096, 100)
        assert (s.ptr, s.nbytes, s.device, s.owner) == (a.ptr + 4096, 100, Device("cpu"), a)
        assert a.span().nbytes == a.nbytes
        with pytest.raises(ArenaError, match=rf"\[{a.nbytes - 10:,}, {a.nbytes + 10:,}\) is outside"):
            a.span(a.nbytes - 10, 20)
        assert a.span(np.int64(4096), np.int32(100)) == s
        for offset, nbytes in ((0.5, 16), (0, 16.0), ("0", 16)):  # a float offset made a float pointer
            with pytest.raises(ArenaError, match=rf"must be integers, got offset {offset!r} and nbytes {nbytes!r}"):
                a.span(offset, nbytes)


# ---------------------------------------------------------------------------------------------
# Bad input and lifetime
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes, message", [(0, "must be positive, got 0"), (-4096, "must be positive, got -4,096"),
                                             (1.5, "must be an int"), (True, "must be an int"), ("10", "must be an int")])
def test_bad_sizes(nbytes, message):
    with pytest.raises(ArenaError, match=message):
        Arena.create(nbytes, "cpu")


def test_too_big_host_arena_is_refused_before_allocating():
    before = arena_fds()
    with pytest.raises(OutOfMemoryError, match=r"needs 1,125,899,906,842,624 bytes but only [\d,]+ are free") as info:
        Arena.create(1 << 50, "cpu")
    assert info.value.nbytes_needed == 1 << 50 and 0 < info.value.nbytes_free < 1 << 50
    assert arena_fds() == before


def test_bad_devices():
    with pytest.raises(FlashBootError, match="cannot parse device 'gpu0'"):
        Arena.create(MiB, "gpu0")
    with pytest.raises(ArenaError, match="access=.* applies to CUDA arenas"):
        Arena.create(MiB, "cpu", access="all")


def test_close_twice_and_use_after_close():
    a = Arena.create(MiB, "cpu")
    a.close()
    assert a.closed
    with pytest.raises(ArenaError, match=rf"arena {a.arena_id} is already closed"):
        a.close()
    for use in (lambda: a.view(0, 4, "float32"), a.bytes, a.span, a.export, lambda: a.ptr):
        with pytest.raises(ArenaError, match=rf"arena {a.arena_id} is closed"):
            use()


def test_an_arena_made_with_segments_now_makes_the_rest_when_first_needed():
    """``segments_now``: the first segments at once, each other one when an export, a view or a
    span needs it, all of them for bytes(), ptr, export() (a served load hands the daemon the first
    batch while the rest are made)."""
    seg = HOST_GRANULARITY
    with Arena.create(5 * seg, "cpu", segment_bytes=seg, segments_now=2) as a:
        assert a.segments == 5 and a.mapped_nbytes == 2 * seg
        assert len([m for m in arena_maps() if a.arena_id in m]) == 2
        assert len(a.export_segments(2, 3)) == 1 and a.mapped_nbytes == 3 * seg  # those an export needs
        v = a.view(4 * seg, (seg // 4,), "float32")  # the one a view needs, and no other
        assert a.mapped_nbytes == 4 * seg
        v.fill_(2.5)
        data = pattern(a.nbytes, 7)
        a.bytes().numpy()[:] = data  # every segment, the rest made now
        assert a.mapped_nbytes == a.nbytes
        assert np.array_equal(a.bytes().numpy(), data)
        desc = a.export()
        assert len(desc.fds) == 5 and len(set(desc.fds)) == 5
        with Arena.open(desc, "cpu") as other:
            assert np.array_equal(other.bytes().numpy(), data)


def test_closing_an_arena_with_segments_still_to_make_releases_what_it_made():
    fds, maps = arena_fds(), arena_maps()
    a = Arena.create(6 * HOST_GRANULARITY, "cpu", segment_bytes=HOST_GRANULARITY, segments_now=1)
    a.export_segments(0, 3)
    assert len(arena_fds()) == len(fds) + 3
    a.close()
    assert arena_fds() == fds and arena_maps() == maps
    with pytest.raises(ArenaError, match="is closed"):
        a.export_segments(3, 4)


def test_an_arena_with_segments_still_to_make_sleeps_and_wakes_whole():
    seg = HOST_GRANULARITY
    with Arena.create(4 * seg, "cpu", segment_bytes=seg, segments_now=1) as a:
        a.sleep()  # makes the rest first, then releases every segment
        assert a.asleep and not [m for m in arena_maps() if a.arena_id in m]
        a.wake()
        data = pattern(a.nbytes, 3)
        a.bytes().numpy()[:] = data
        assert np.array_equal(a.bytes().numpy(), data) and len(a.export().fds) == 4


def test_a_segment_that_cannot_be_made_later_releases_the_others_of_its_call_and_a_retry_works(monkeypatch):
    seg = HOST_GRANULARITY
    fds = arena_fds()
    with Arena.create(4 * seg, "cpu", segment_bytes=seg, segments_now=1) as a:
        real_seal, calls = host_backing._host_seal, []

        def failing_seal(fd):
            calls.append(fd)
            if len(calls) == 2:  # the second segment of the call: the first one is made by then
                raise OSError(28, "injected: no space")
            return real_seal(fd)

        monkeypatch.setattr(host_backing, "_host_seal", failing_seal)
        with pytest.raises(ArenaError, match=r"making segment\(s\) \[1, 2\] .*injected: no space"):
            a.export_segments(0, 3)
        assert a.mapped_nbytes == seg and len(arena_fds()) == len(fds) + 1  # segment 1 released again
        monkeypatch.undo()
        data = pattern(a.nbytes, 11)
        a.bytes().numpy()[:] = data
        assert np.array_equal(a.bytes().numpy(), data) and len(arena_fds()) == len(fds) + 4
        assert len(set(a.export().fds)) == 4
    assert arena_fds() == fds


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_segments_now_must_be_a_positive_int(bad):
    with pytest.raises(ArenaError, match="segments_now must be a positive int"):
        Arena.create(4 * HOST_GRANULARITY, "cpu", segments_now=bad)


def test_context_manager_closes():
    with Arena.create(MiB, "cpu") as a:
        assert arena_maps()
    assert a.closed and not [m for m in arena_maps() if a.arena_id in m]


def test_dropped_arena_lives_while_views_do_then_is_released_with_a_warning():
    a = Arena.create(MiB, "cpu")
    arena_id = a.arena_id
    v = a.view(0, 8, "int64")
    v[:] = 42
    del a
    gc.collect()
    assert [m for m in arena_maps() if arena_id in m], "a live view must keep the mapping"
    assert v.tolist() == [42] * 8
    with pytest.warns(ResourceWarning, match=f"host arena {arena_id} .* was not closed"):
        del v
        gc.collect()
    assert not [m for m in arena_maps() if arena_id in m]


# ---------------------------------------------------------------------------------------------
# Descriptor, export, open (same process)
# ---------------------------------------------------------------------------------------------


def test_descriptor_is_small_and_round_trips():
    with Arena.create(MiB, "cpu") as a:
        d = a.export()
        assert (d.backend, d.pid, d.nbytes, d.device_index, d.handle_type, d.granularity, d.arena_id,
                d.fabric_handles, d.segments, d.segment_bytes) == (
            "host", os.getpid(), a.nbytes, -1, "memfd", HOST_GRANULARITY, a.arena_id, None, 1, SEGMENT_BYTES)
        assert pickle.loads(pickle.dumps(d)) == d
        assert len(pickle.dumps(d)) < 512
        assert ArenaDescriptor.from_dict(json.loads(json.dumps(d.to_dict()))) == d
        with pytest.raises(dataclasses.FrozenInstanceError):
            d.fds = (0,)
        with pytest.raises(ArenaError, match=r"missing \['fds'\], unknown \['colour'\]"):
            ArenaDescriptor.from_dict({**{k: v for k, v in d.to_dict().items() if k != "fds"}, "colour": 1})
        with pytest.raises(ArenaError, match=r"2,097,152 bytes in segments of 268,435,456 need 1 fds, it lists 2"):
            dataclasses.replace(d, fds=(3, 4))


def test_open_in_same_process_shares_bytes_and_close_keeps_owner_memory():
    with Arena.create(2 * MiB, "cpu") as a:
        with Arena.open(a.export()) as b:
            assert b.imported and b.arena_id == a.arena_id and b.nbytes == a.nbytes
            assert b.ptr != a.ptr
            assert b.export() == a.export()  # an importer hands on the descriptor it came from
            b.bytes()[:1000].numpy()[:] = pattern(1000, 3)
        assert np.array_equal(a.bytes()[:1000].numpy(), pattern(1000, 3))


def test_open_rejects_wrong_fd_and_wrong_device():
    with Arena.create(MiB, "cpu") as a:
        d = a.export()
        r, w = os.pipe()
        try:
            with pytest.raises(ArenaError, match=rf"fd {r} of pid {os.getpid()} is not segment 0 of arena {a.arena_id}: it is 'pipe:"):
                Arena.open(dataclasses.replace(d, fds=(r,)))
            with pytest.raises(ArenaError, match=rf"fd {w} is not segment 0 of arena {a.arena_id}"):
                Arena.open(d, fds=[w])
        finally:
            os.close(r)
            os.close(w)
        with pytest.raises(ArenaError, match=rf"process {os.getpid()} has no open fd 987654"):
            Arena.open(dataclasses.replace(d, fds=(987654,)))
        with pytest.raises(ArenaError, match="fd 987654 given for segment 0 .* is not open"):
            Arena.open(d, fds=[987654])
        with pytest.raises(ArenaError, match="has 1 segments; 2 fds were given"):
            Arena.open(d, fds=[1, 2])
        with pytest.raises(FlashBootError):  # a host arena cannot be mapped on a GPU
            Arena.open(d, "cuda:0")
        with pytest.raises(ArenaError, match="unknown arena backend 'tpu'"):
            Arena.open(dataclasses.replace(d, backend="tpu"))
        with pytest.raises(ArenaError, match="needs an ArenaDescriptor"):
            Arena.open(d.to_dict())
    with pytest.raises(ArenaError, match=rf"pid {os.getpid()}"):
        Arena.open(d)  # the owner closed it: its fd is gone


def test_host_segments_cannot_shrink_and_an_unsealed_memfd_is_refused_by_name():
    """A memfd that shrinks under a process that maps it kills that process (SIGBUS) at its next
    touch: arenas seal their size, and an importer refuses a look-alike without the seal."""
    import fcntl

    with Arena.create(MiB, "cpu") as a:
        d = a.export()
        with pytest.raises(PermissionError):
            os.ftruncate(d.fds[0], 0)
        assert os.fstat(d.fds[0]).st_size == a.nbytes == 2 * MiB
        with Arena.open(d) as b:  # sealed: an importer maps it
            assert b.nbytes == a.nbytes
        fake = os.memfd_create(host_backing._memfd_name(a.arena_id, 0), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fake, a.nbytes)
            fds_before, maps_before = open_fds(), arena_maps()
            with pytest.raises(ArenaError, match=rf"fd {fake} \(segment 0 of arena {a.arena_id}, 2,097,152 bytes\) "
                                                 r"is not sealed against shrinking: seals found: none; "
                                                 r"required: F_SEAL_SHRINK"):
                Arena.open(d, fds=[fake])
            fcntl.fcntl(fake, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            with pytest.raises(ArenaError, match=r"seals found: F_SEAL_SEAL\+F_SEAL_GROW; required: F_SEAL_SHRINK"):
                Arena.open(d, fds=[fake])
            assert open_fds() == fds_before and arena_maps() == maps_before
        finally:
            os.close(fake)


# ---------------------------------------------------------------------------------------------
# Across real processes
# ---------------------------------------------------------------------------------------------


def test_child_sees_parent_writes_and_parent_sees_child_writes(child):
    with Arena.create(3 * MiB, "cpu") as a:
        a.bytes()[:MiB].numpy()[:] = pattern(MiB, 1)
        reply = child("open", name="p", descriptor=a.export().to_dict())
        assert reply == {"nbytes": a.nbytes, "imported": True}
        assert child("check", name="p", offset=0, nbytes=MiB, seed=1)["equal"]
        assert not child("check", name="p", offset=0, nbytes=MiB, seed=2)["equal"]
        child("write", name="p", offset=2 * MiB + 5, nbytes=MiB - 5, seed=9)
        assert np.array_equal(a.bytes()[2 * MiB + 5:3 * MiB].numpy(), pattern(MiB - 5, 9))
        assert int(a.bytes()[3 * MiB:].sum()) == 0
        child("close", name="p")
        assert np.array_equal(a.bytes()[:MiB].numpy(), pattern(MiB, 1))  # importer close freed nothing


def test_parent_opens_an_arena_the_child_created(child):
    d = ArenaDescriptor.from_dict(child("create", name="c", nbytes=MiB)["descriptor"])
    assert d.pid == child.proc.pid and d.pid != os.getpid()
    child("write", name="c", offset=0, nbytes=4096, seed=5)
    with Arena.open(d) as b:
        assert np.array_equal(b.bytes()[:4096].numpy(), pattern(4096, 5))
        b.bytes()[4096:8192].numpy()[:] = pattern(4096, 6)
        assert child("check", name="c", offset=4096, nbytes=4096, seed=6)["equal"]
    child("close", name="c")
    with pytest.raises(ArenaError, match=rf"pid {d.pid}: process {d.pid} has no open fd {d.fds[0]}"):
        Arena.open(d)


def test_fd_over_a_unix_socket(child):
    with Arena.create(MiB, "cpu") as a:
        a.bytes()[:4096].numpy()[:] = pattern(4096, 11)
        d = a.export()
        send_fds(child.sock, list(d.fds), json.dumps(d.to_dict()).encode())
        assert child("open_socket", name="s") == {"nbytes": a.nbytes}
        assert child("check", name="s", offset=0, nbytes=4096, seed=11)["equal"]
        child("write", name="s", offset=8192, nbytes=100, seed=12)
        assert np.array_equal(a.bytes()[8192:8292].numpy(), pattern(100, 12))
        child("close", name="s")


def test_descriptor_from_an_exited_process_names_the_pid():
    src = "import json; from flashboot import Arena; a = Arena.create(1 << 20, 'cpu'); print(json.dumps(a.export().to_dict()))"
    out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120, check=True)
    d = ArenaDescriptor.from_dict(json.loads(out.stdout))
    with pytest.raises(ArenaError, match=rf"exported by pid {d.pid}: process {d.pid} has exited"):
        Arena.open(d)


# ---------------------------------------------------------------------------------------------
# fd passing
# ---------------------------------------------------------------------------------------------


def test_pidfd_getfd_duplicates_an_own_fd():
    r, w = os.pipe()
    try:
        dup = pidfd_getfd(os.getpid(), w)
        try:
            os.write(dup, b"hi")
            assert os.read(r, 2) == b"hi"
        finally:
            os.close(dup)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(RendezvousError, match="positive pid"):
        pidfd_getfd(0, 1)


def test_recv_fd_timeout_and_closed_peer():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(WaitTimeoutError, match="within 0.05 s"):
        recv_fd(b, timeout_s=0.05)
    a.close()
    with pytest.raises(RendezvousError, match="closed the Unix socket before sending an fd"):
        recv_fd(b, timeout_s=5)
    b.close()


def test_send_fd_round_trip_in_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        send_fd(a, w)
        fd, msg = recv_fd(b, timeout_s=5)
        assert msg == b"" and fd not in (r, w)
        os.write(fd, b"x")
        os.close(fd)
        assert os.read(r, 1) == b"x"
    finally:
        for f in (r, w):
            os.close(f)
        a.close()
        b.close()


# ---------------------------------------------------------------------------------------------
# Transactions and leaks
# ---------------------------------------------------------------------------------------------


def test_undo_runs_in_reverse_and_all_steps_run_when_one_fails():
    order = []
    u = _Undo("test")
    u.push("a", lambda: order.append("a"))
    u.push("b", lambda: (_ for _ in ()).throw(OSError("b broke")))
    u.push("c", lambda: order.append("c"))
    with pytest.raises(ArenaError, match="releasing test failed: OSError: b broke"):
        u.release()
    assert order == ["c", "a"] and len(u) == 0
    u.release()  # nothing left: a no-op


@pytest.mark.parametrize("step", ["_host_reserve", "_host_memfd", "_host_truncate", "_host_seal", "_host_map_segment"])
def test_create_failure_halfway_releases_what_was_made(monkeypatch, step):
    fds_before, maps_before = open_fds(), arena_maps()
    real, calls = getattr(host_backing, step), []

    def broken(*args):
        calls.append(args)
        if len(calls) < 2 and step != "_host_reserve":  # let the first segment succeed: it must be undone too
            return real(*args)
        raise OSError(28, f"injected failure in {step}")

    monkeypatch.setattr(host_backing, step, broken)
    with pytest.raises(ArenaError, match=f"creating a 6,291,456-byte host arena failed: .*injected failure in {step}"):
        Arena.create(5 * MiB, "cpu", segment_bytes=2 * MiB)
    assert open_fds() == fds_before
    assert arena_maps() == maps_before


@pytest.mark.parametrize("step", ["_host_reserve", "_host_map_segment"])
def test_open_failure_halfway_releases_what_was_made(monkeypatch, step):
    with Arena.create(MiB, "cpu") as a:
        fds_before, maps_before = open_fds(), arena_maps()
        monkeypatch.setattr(host_backing, step, lambda *args: (_ for _ in ()).throw(OSError(12, "injected")))
        with pytest.raises(ArenaError, match="injected"):
            Arena.open(a.export())
        assert open_fds() == fds_before
        assert arena_maps() == maps_before


# ---------------------------------------------------------------------------------------------
# Segments
# ---------------------------------------------------------------------------------------------


def test_segments_are_one_contiguous_range_of_separate_memfds():
    with Arena.create(5 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        assert (a.nbytes, a.segments, a.segment_bytes) == (6 * MiB, 3, 2 * MiB)
        d = a.export()
        assert d.segments == 3 and len(set(d.fds)) == 3
        assert [os.fstat(fd).st_size for fd in d.fds] == [2 * MiB] * 3
        names = [os.readlink(f"/proc/self/fd/{fd}") for fd in d.fds]
        assert names == [f"/memfd:flashboot-arena-{a.arena_id}.{i} (deleted)" for i in range(3)]
        # a write across a segment boundary lands in both memfds, at their own offsets
        a.bytes()[2 * MiB - 3:2 * MiB + 3].numpy()[:] = np.arange(1, 7, dtype=np.uint8)
        assert os.pread(d.fds[0], 3, 2 * MiB - 3) == bytes([1, 2, 3])
        assert os.pread(d.fds[1], 3, 0) == bytes([4, 5, 6])
    for bad, why in ((3 * MiB, "not a multiple of the allocation granularity"), (0, "positive int"),
                     (True, "positive int")):
        with pytest.raises(ArenaError, match=why):
            Arena.create(MiB, "cpu", segment_bytes=bad)


def test_an_opened_arena_maps_segments_on_first_use():
    with Arena.create(7 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        a.bytes().numpy()[:] = pattern(a.nbytes, 4)
        with Arena.open(a.export()) as b:
            assert b.segments == 4 and b.mapped_nbytes == 2 * MiB  # the first one, at open
            assert b.map_stats == {"segments": 0, "map_ms": 0.0}
            s = b.span(5 * MiB, 100)  # inside segment 2 only
            assert b.mapped_nbytes == 4 * MiB and b.map_stats["segments"] == 1
            assert np.array_equal(np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * 100).from_address(s.ptr)),
                                  pattern(a.nbytes, 4)[5 * MiB:5 * MiB + 100])
            v = b.view(2 * MiB - 8, (4,), "float32")  # straddles segments 0 and 1
            assert b.mapped_nbytes == 6 * MiB
            assert v.numpy().tobytes() == pattern(a.nbytes, 4)[2 * MiB - 8:2 * MiB + 8].tobytes()
            b.map_range(0, 1)  # mapped already: nothing to do
            assert b.map_stats["segments"] == 2
            with pytest.raises(ArenaError, match="outside arena"):
                b.map_range(7 * MiB, 2 * MiB)
            b.ptr  # maps the rest
            assert b.mapped_nbytes == b.nbytes == 8 * MiB and b.map_stats["segments"] == 3
            assert np.array_equal(b.bytes().numpy(), a.bytes().numpy())


def test_segments_mapped_after_the_exporter_exits_hold_its_bytes(child):
    d = ArenaDescriptor.from_dict(child("create", name="gone", nbytes=6 * MiB, segment_bytes=2 * MiB)["descriptor"])
    child("write", name="gone", offset=0, nbytes=6 * MiB, seed=8)
    with Arena.open(d) as b:
        assert b.mapped_nbytes == 2 * MiB
        child("close", name="gone")  # the exporter lets go; our fds keep every segment
        assert np.array_equal(b.bytes().numpy(), pattern(6 * MiB, 8))


def test_more_segments_than_one_unix_message_carries(child):
    n = SCM_MAX_FD + 7
    with Arena.create(n * 2 * MiB, "cpu", segment_bytes=2 * MiB) as a:
        a.bytes().numpy()[::MiB] = 7
        d = a.export()
        assert d.segments == n
        send_fds(child.sock, list(d.fds), json.dumps(d.to_dict()).encode())
        assert child("open_socket", name="many") == {"nbytes": a.nbytes}
        child("write", name="many", offset=a.nbytes - 100, nbytes=100, seed=3)
        assert np.array_equal(a.bytes()[a.nbytes - 100:].numpy(), pattern(100, 3))
        child("close", name="many")


def test_no_fd_or_mapping_leaks_over_create_export_open_close_cycles(child):
    gc.collect()
    fds_before, maps_before = open_fds(), arena_maps()
    for i in range(5):
        a = Arena.create(3 * MiB, "cpu", segment_bytes=2 * MiB)
        a.view(0, 16, "float32").fill_(i)
        d = a.export()
        b = Arena.open(d)
        c = Arena.open(d, fds=d.fds)
        assert float(c.view(0, 16, "float32")[3]) == i
        c.map_range()
        child("open", name="leak", descriptor=d.to_dict())
        child("close", name="leak")
        for x in (c, b, a):
            x.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]  # all closed explicitly
    assert open_fds() == fds_before
    assert arena_maps() == maps_before


def test_segments_to_map_are_granted_per_run_of_adjacent_ones():
    from flashboot.arena.segments import _adjacent_runs

    assert _adjacent_runs([]) == []
    assert _adjacent_runs([3]) == [(3, 4)]
    assert _adjacent_runs([1, 2, 3, 5, 7, 8]) == [(1, 4), (5, 6), (7, 9)]
    assert _adjacent_runs(list(range(1, 54))) == [(1, 54)]


_VIEW_AFTER_CLOSE = """
import gc, os, sys, warnings
import torch
import flashboot
from flashboot import Arena

def memfds():
    fds = os.listdir("/proc/self/fd")  # the listing's own fd is gone once listed
    return sum(os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
               for fd in fds)

base = memfds()
a = Arena.create(6 << 20, "cpu", segment_bytes=2 << 20)
weight = a.view(4 << 20, (256, 4), torch.float32)  # a model's parameter, bound to the arena
weight.copy_(torch.arange(1024, dtype=torch.float32).reshape(256, 4))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a.close(keep_viewed=True)
print(memfds() - base, float(weight.sum()), *{str(w.message) for w in caught}, sep="|")
del weight
print(memfds() - base)

loaded = flashboot.load(sys.argv[1], 0, "cpu", stream=True, verify=True)
name, t = next(iter(loaded.tensors.items()))
want = t.clone()
loaded.close()
gc.collect()
print(torch.equal(t, want), len(loaded.tensors))
"""


def test_a_view_read_after_its_arena_closed_reads_its_bytes_and_the_last_view_releases_them(tmp_path):
    """A view a model still held read unmapped memory once its arena closed: a segfault on the host
    (on CUDA an illegal address that ends the context). The memory now goes with the last view."""
    from _preload_helpers import make_tiny_image

    image = make_tiny_image(tmp_path)
    run = subprocess.run([sys.executable, "-c", _VIEW_AFTER_CLOSE, str(image)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # -11 (SIGSEGV) before
    closed, dropped, loaded = run.stdout.splitlines()
    held, total, warned = closed.split("|")
    assert int(held) == 3 and float(total) == sum(range(1024)), closed  # 3 segments still there, bytes intact
    assert warned.startswith("arena ") and "closed while views of it are still held: its 6,291,456 bytes stay " \
                                           "mapped until they are dropped" in warned, warned
    assert dropped == "0"
    assert loaded == "True 0"  # a loaded image's tensor too; the image's own table emptied
