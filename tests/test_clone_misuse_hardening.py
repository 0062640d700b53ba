"""FlashClone misused as a hostile but realistic user would: two holders on one registry, a
release of a name nothing holds, a store host that does not resolve, two seeds on one namespace,
a ring clone of a missing image. Each one a clear FlashBootError naming the problem."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flashboot.arena import Arena
from flashboot.errors import ArenaError, FlashBootError, RendezvousError

from _clone_helpers import _token, store  # noqa: F401  (fixtures)
from _clone_helpers import MiB, TOKEN, env, finish, serve_in_thread, spawn_cli, stop

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------
# the holder
# ---------------------------------------------------------------------------------------------


def test_second_holder_on_a_registry_is_refused_naming_the_first(tmp_path):
    registry = tmp_path / "reg"
    first = spawn_cli("hold", "--registry", registry)
    try:
        assert "holder ready" in first.stdout.readline()
        second = subprocess.run([sys.executable, "-m", "flashboot.cli", "hold", "--registry", str(registry)],
                                env=env(), capture_output=True, text=True, timeout=30)
        assert second.returncode != 0 and "holder ready" not in second.stdout
        assert "another holder" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None  # the first one serves on
    finally:
        stop(first)


def test_holder_lock_goes_with_the_holder(tmp_path):
    from flashboot.flashclone.holder import Holder

    a = Holder(registry=tmp_path / "reg")
    with pytest.raises(FlashBootError, match=f"another holder \\(pid {os.getpid()}\\)"):
        Holder(registry=tmp_path / "reg")
    a.close()
    b = Holder(registry=tmp_path / "reg")  # the first one's close let go of the registry
    b.close()


def test_one_holder_keeps_what_it_adopts_and_releases_it(tmp_path):
    from flashboot.flashclone.holder import Holder, hand_over, held_record, release

    registry = tmp_path / "reg"
    with Holder(registry=registry) as holder:
        arena = Arena.create(MiB, "cpu")
        import threading

        t = threading.Thread(target=holder.serve_forever, kwargs={"handle_signals": False})
        t.start()
        try:
            hand_over(arena, "w", registry=registry, timeout_s=10)
            arena.close()
            assert held_record("w", registry=registry)["holder_pid"] == os.getpid()
            release("w", registry=registry, timeout_s=10)
            assert "w" not in holder.held and held_record("w", registry=registry) is None
        finally:
            holder.stop()
            t.join(10)


def test_release_of_a_name_nothing_holds_raises(tmp_path):
    from flashboot.flashclone.holder import REQUESTS, Holder, release

    registry = tmp_path / "reg"
    with Holder(registry=registry):
        with pytest.raises(ArenaError, match="nothing is held as 'typo'"):
            release("typo", registry=registry, timeout_s=2)
    assert not (registry / REQUESTS / "typo.json").exists()  # no request left for a holder to find


def test_release_passes_its_timeout_to_the_store_connect(monkeypatch):
    from flashboot.flashclone import holder as holder_mod
    from flashboot.flashclone.rendezvous import Rendezvous

    seen = {}

    def connect(address, token=None, **kw):
        seen.update(kw)
        raise RendezvousError("stop here")

    monkeypatch.setattr(Rendezvous, "connect", staticmethod(connect))
    with pytest.raises(RendezvousError, match="stop here"):
        holder_mod.release("w", store="127.0.0.1:9", timeout_s=1.5)
    assert seen["timeout_s"] == 1.5


def test_read_only_holder_calls_create_no_registry(tmp_path):
    from flashboot.flashclone.holder import held_descriptor, held_record, list_held, release

    missing = tmp_path / "typo"
    assert held_record("w", registry=missing) is None
    assert list_held(missing) == {}
    with pytest.raises(ArenaError, match="no arena is held"):
        held_descriptor("w", registry=missing)
    with pytest.raises(ArenaError, match="nothing is held"):
        release("w", registry=missing, timeout_s=1)
    assert not missing.exists()


# ---------------------------------------------------------------------------------------------
# an unresolvable store host
# ---------------------------------------------------------------------------------------------

_NOSUCH = "nosuchhost.invalid"  # .invalid never resolves (RFC 6761)


@pytest.mark.parametrize("host", [True, False])
def test_connect_to_an_unresolvable_host_names_it(host):
    from flashboot.errors import WaitTimeoutError
    from flashboot.flashclone.rendezvous import Rendezvous

    with pytest.raises(RendezvousError, match=f"store host '{_NOSUCH}'.*does not resolve") as info:
        Rendezvous.connect(f"{_NOSUCH}:1234", TOKEN, host=host, timeout_s=20)
    assert not isinstance(info.value, WaitTimeoutError)


def test_store_server_on_an_unresolvable_host_names_it():
    from flashboot.flashclone.store import StoreServer

    with pytest.raises(RendezvousError, match=f"store host '{_NOSUCH}' does not resolve"):
        StoreServer(f"{_NOSUCH}:0", timeout_s=20)


def test_cli_store_on_an_unresolvable_host_is_one_line():
    run = subprocess.run([sys.executable, "-m", "flashboot.cli", "store", f"{_NOSUCH}:0"], env=env(),
                         capture_output=True, text=True, timeout=50)
    assert run.returncode != 0
    assert f"store host '{_NOSUCH}' does not resolve" in run.stderr
    assert "frame #" not in run.stderr and "Traceback" not in run.stderr


# ---------------------------------------------------------------------------------------------
# two seeds on one namespace
# ---------------------------------------------------------------------------------------------


def test_a_seed_published_over_stops_the_first_naming_the_second(store, tmp_path):
    """The second seed serves (a restart over a crashed seed's record must work); the first had
    served on silently, saying it served, while every clone went to the other."""
    import flashboot
    from _clone_helpers import write_raw_image

    address, rdv = store
    path = tmp_path / "image.bin"
    write_raw_image(path, MiB, 5)
    a = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    t, errors = serve_in_thread(a)
    b = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
    try:
        t.join(20)
        assert not t.is_alive(), "the superseded seed served on"
        assert len(errors) == 1 and isinstance(errors[0], RendezvousError), errors
        msg = str(errors[0])
        assert f"pid {os.getpid()}" in msg and b.generation in msg and a.generation in msg and "'default'" in msg
        assert a.superseded_by["generation"] == b.generation
        # the replacement's record is left alone, and it serves
        assert rdv.read("seed", what="the seed", timeout_s=1).body["generation"] == b.generation
    finally:
        a.stop()
        t.join(10)
        a.close()
        b.close()


def test_cli_seed_published_over_exits_with_one_line(store, tmp_path):
    import flashboot
    from _clone_helpers import write_raw_image

    address, rdv = store
    path = tmp_path / "image.bin"
    write_raw_image(path, MiB, 6)
    first = spawn_cli("seed", path, "--store", address, "--device", "cpu")
    try:
        assert "seed ready" in first.stdout.readline()
        b = flashboot.seed(address, str(path), "cpu", serve_nccl=False, timeout_s=10)
        try:
            rc, out, err = finish(first, 20)
        finally:
            b.close()
        assert rc != 0 and "seed stopped" not in out
        assert "another seed" in err and b.generation in err and "Traceback" not in err, err
    finally:
        stop(first)


# ---------------------------------------------------------------------------------------------
# a ring clone of a missing image
# ---------------------------------------------------------------------------------------------


def test_ring_load_of_a_missing_image_names_it(tmp_path):
    from flashboot.flashclone.rendezvous import free_port
    from flashboot.flashclone.ring import ring_load

    missing = tmp_path / "nope.bin"
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(FlashBootError, match=f"ring image '{missing}' does not exist"):
        ring_load(address, missing, "cpu", members=1, timeout_s=5)
    with pytest.raises(FlashBootError, match=f"ring image '{missing}' does not exist"):
        ring_load(address, str(missing), "cpu", members=2, timeout_s=5)


# ---------------------------------------------------------------------------------------------
# clone(into=...) of the wrong size
# ---------------------------------------------------------------------------------------------


_INTO_CLONE = """
import sys, flashboot
from flashboot.arena import Arena
into = Arena.create(int(sys.argv[2]), "cpu")
try:
    flashboot.clone(sys.argv[1], "cpu", "star", timeout_s=10, into=into, transport=sys.argv[3])
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
print("into open:", not into.closed, flush=True)
"""


@pytest.mark.parametrize("transport", ["posix_fd", "nccl"])
@pytest.mark.parametrize("into_mib", [2, 8])
def test_a_clone_into_an_arena_of_another_size_is_refused_naming_both(store, transport, into_mib):
    """``clone(into=...)`` with an arena smaller than the seed's: the broadcast fallback aborted the
    process (gloo: "Received data size doesn't match expected size"); a mapping clone blamed
    "different allocation granularity". Now both refuse it, naming the two sizes, and leave it open."""
    import flashboot

    address, _ = store
    seed_arena = Arena.create(4 * MiB, "cpu")
    s = flashboot.seed(address, seed_arena, "cpu", timeout_s=10)
    try:
        proc = subprocess.run([sys.executable, "-c", _INTO_CLONE, address, str(into_mib * MiB), transport], env=env(),
                              capture_output=True, text=True, timeout=50)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (f"ArenaError clone(into=...): the arena given holds {into_mib * MiB:,} bytes on cpu; the seed's "
                f"image needs one of exactly {4 * MiB:,} bytes on cpu") in proc.stdout, proc.stdout
        assert "into open: True" in proc.stdout
    finally:
        s.close()
        seed_arena.close()


# ---------------------------------------------------------------------------------------------
# a seed's nbytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1.5, True, 0, -5, "4096"])
def test_a_seed_refuses_an_nbytes_that_is_no_positive_int_naming_it(store, nbytes):
    """``seed(arena, nbytes=1.5)`` (or True) had been cut to 1 by int(): the seed served one byte of
    the arena to every clone, without a word. Now refused, with the value, before anything is published."""
    import flashboot

    address, rdv = store
    arena = Arena.create(MiB, "cpu")
    try:
        with pytest.raises(RendezvousError, match=rf"seed nbytes .* must be a positive int, got {nbytes!r}$"):
            flashboot.seed(address, arena, "cpu", nbytes=nbytes, serve_nccl=False, timeout_s=10)
        with pytest.raises(FlashBootError):  # nothing was published
            rdv.read("seed", what="the seed", timeout_s=0.5)
        import numpy as np

        s = flashboot.seed(address, arena, "cpu", nbytes=np.int64(4096), serve_nccl=False, timeout_s=10)
        try:  # an integral nbytes of any int type still replicates that much
            assert s.manifest.nbytes == 4096
        finally:
            s.close()
    finally:
        arena.close()


def test_a_seed_of_an_image_refuses_an_nbytes_that_is_not_the_images_naming_both(store, tmp_path):
    """``seed(image_dir, nbytes=4096)`` (or a LoadedImage's) had dropped nbytes without a word: the
    manifest and metadata published were the whole image's, and every clone received all of it.
    An image is replicated whole, so a different nbytes is refused, naming both sizes, before
    anything is loaded or published; the image's own size is accepted."""
    import flashboot
    from flashboot.flashclone.manifest import Manifest

    from _clone_helpers import make_prepacked_image

    address, rdv = store
    image = make_prepacked_image(tmp_path)
    size = flashboot.layouts.read_image_metadata(image, 0).image_nbytes
    with pytest.raises(RendezvousError, match=rf"nbytes=4,096 differs from the {size:,} bytes of the image .*img"):
        flashboot.seed(address, image, "cpu", nbytes=4096, serve_nccl=False, timeout_s=10)
    with pytest.raises(FlashBootError):  # nothing was published
        rdv.read("seed", what="the seed", timeout_s=0.5)
    loaded = flashboot.load(image, 0, "cpu", shm_dir=tmp_path / "shm", timeout_s=20)
    try:
        with pytest.raises(RendezvousError, match=rf"nbytes=4,096 differs from the {size:,} bytes of the LoadedImage"):
            flashboot.seed(address, loaded, "cpu", nbytes=4096, serve_nccl=False, timeout_s=10)
        s = flashboot.seed(address, loaded, "cpu", nbytes=size, serve_nccl=False, timeout_s=10)
        try:
            assert s.manifest.nbytes == size and rdv.read("seed", what="the seed").body["manifest"]["nbytes"] == size
        finally:
            s.close()
    finally:
        loaded.close()
    arena = Arena.create(MiB, "cpu")
    try:  # a given manifest says what is replicated: an nbytes that contradicts it is refused too
        manifest = Manifest.of_arena(arena, 8192, 4096)
        with pytest.raises(RendezvousError, match="nbytes=4,096 differs from the 8,192 bytes the given manifest"):
            flashboot.seed(address, arena, "cpu", nbytes=4096, manifest=manifest, serve_nccl=False, timeout_s=10)
    finally:
        arena.close()


@pytest.mark.parametrize("chunk", [4096.7, True, -4096])
def test_a_seed_refuses_a_checksum_chunk_that_is_no_positive_int_naming_it(store, chunk):
    """``checksum_chunk_bytes=True`` had been cut to 1 by int(): a manifest of one checksum per
    byte of the arena (8,192 of them for 8 KiB), computed and published without a word."""
    import flashboot

    address, _ = store
    arena = Arena.create(MiB, "cpu")
    try:
        with pytest.raises(RendezvousError, match=rf"seed checksum_chunk_bytes must be a positive int, got {chunk!r}$"):
            flashboot.seed(address, arena, "cpu", nbytes=8192, checksum_chunk_bytes=chunk, serve_nccl=False,
                           timeout_s=10)
    finally:
        arena.close()
