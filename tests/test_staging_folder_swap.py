"""A staging folder swapped between its ownership check and the use of its files.

Anyone who may write the shm root (its owner, where another user made ``/dev/shm/flashboot``
first) can rename a staging folder away and put another, or a symlink, at its name. Checked by
name and then used by name, the folder the check saw was not the one the engine mapped, the
daemon served or the stager wrote into. The swap is made right after a check passes: each
``trusted_uids()`` call is one check (the owner of a folder or a file), and the swap follows the
N-th, for every N a load or a stage makes."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

import flashboot
from flashboot.errors import LayoutError
from flashboot.flashload import server, staging
from flashboot.flashload import shm as shm_files
from flashboot.flashload.shm import staged_paths

from _preload_helpers import make_tiny_image  # noqa: E402  (tests/ is on the path)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another uid needs root to make")


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_tiny_image(tmp_path_factory.mktemp("swap"))


def _attacker_folder(real: Path, where: Path) -> Path:
    """A copy of the staged folder ``real`` with one byte of its image flipped, of another user."""
    planted = where / "planted"
    shutil.copytree(real, planted)
    img = next(planted.glob("rank-*.img"))
    data = bytearray(img.read_bytes())
    data[100] ^= 0xFF
    img.write_bytes(bytes(data))
    for p in (planted, *planted.iterdir()):
        os.chown(p, NOBODY, NOBODY)
    return planted


def _swap_after(monkeypatch, n: int, folder: Path, swap) -> list:
    """Right after the ``n``-th check (1-based) passes, ``swap()`` once; returns [swapped?]."""
    real, calls, done = shm_files.trusted_uids, [0], []

    def checked():
        calls[0] += 1
        trusted = real()
        if calls[0] == n and not done:
            done.append(True)
            folder.rename(folder.with_name("checked-and-moved"))
            swap()
        return trusted

    monkeypatch.setattr(shm_files, "trusted_uids", checked)
    return done


def _put_back(folder: Path, planted: Path) -> None:
    """The checked folder back at its name, the planted one (or the symlink to it) out of it."""
    moved = folder.with_name("checked-and-moved")
    if not moved.exists():
        return  # not swapped
    if os.path.islink(folder):
        folder.unlink()
    elif folder.exists():
        folder.rename(planted)
    moved.rename(folder)


@needs_root
@pytest.mark.parametrize("how", ["folder", "symlink"])
def test_a_folder_swapped_after_its_check_never_gives_a_load_the_planted_bytes(image, tmp_path, monkeypatch, how):
    """Defect: the engine read the .ready (folder and file checked) and then mapped the image by
    its path: a folder swapped in between gave it another user's bytes, which it loaded without a
    word (no verify by default). Now the image comes from the very folder fd that was checked:
    a swap after any check leaves the load with the checked folder's bytes, or refused by name."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = staged_paths(image, 0, shm)
    real = shm_files.rank_source(image, 0).path.read_bytes()
    planted = _attacker_folder(paths.dir, tmp_path)

    def swap():
        if how == "folder":
            planted.rename(paths.dir)
        else:
            os.symlink(planted, paths.dir)
            os.lchown(paths.dir, NOBODY, NOBODY)

    outcomes = []
    for n in range(1, 7):
        swapped = _swap_after(monkeypatch, n, paths.dir, swap)
        try:
            with flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=5, stream=False) as loaded:
                got = bytes(loaded.arena.bytes()[:len(real)].numpy())
            outcomes.append((n, bool(swapped), "real" if got == real else "PLANTED"))
        except LayoutError as exc:
            assert swapped and (f"belongs to uid {NOBODY}" in str(exc) or "is a symlink" in str(exc)), exc
            outcomes.append((n, True, "refused"))
        finally:
            monkeypatch.undo()
            _put_back(paths.dir, planted)
    assert all(got != "PLANTED" for _, _, got in outcomes), outcomes
    assert any(swapped for _, swapped, _ in outcomes), outcomes  # the swap did happen (the hook is live)


@needs_root
def test_the_daemon_holds_the_checked_folders_image_not_one_swapped_in(image, tmp_path, monkeypatch):
    """The served-load daemon read the .ready and then opened the image by its path (O_RDWR, kept
    open and served to every engine): the same swap had it serve the planted bytes."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = staged_paths(image, 0, shm)
    real = shm_files.rank_source(image, 0).path.read_bytes()
    planted = _attacker_folder(paths.dir, tmp_path)
    cfg = staging.PreloadConfig(str(image), shm_dir=str(shm), serve=True)
    for n in range(1, 6):
        daemon = server.PreloadServer(cfg, log=lambda line: None)
        swapped = _swap_after(monkeypatch, n, paths.dir, lambda: planted.rename(paths.dir))
        try:
            daemon._make_resident(0)
            res = daemon.residents[0]
            held = os.pread(res.fd, len(real), 0)
            assert held == real, f"the daemon holds the planted bytes (swap after check {n})"
        except LayoutError as exc:
            assert swapped and f"belongs to uid {NOBODY}" in str(exc), exc
        finally:
            monkeypatch.undo()
            daemon.close()
            _put_back(paths.dir, planted)


@needs_root
def test_a_stager_never_writes_through_a_folder_swapped_in_after_its_check(image, tmp_path, monkeypatch):
    """Defect: stage_rank checked the folder's owner and then opened its lock (O_CREAT, then
    truncated to sign it with the pid), the .partial, the temporary .ready by path: a folder of
    the attacker's swapped in after the check had the stager truncate whatever file the
    attacker's ``rank-0.lock`` symlink named (here a file of ours), and write the copy and its
    .ready into the attacker's folder. Now every file goes into the folder that was checked."""
    shm = tmp_path / "shm"
    paths = staged_paths(image, 0, shm)
    shm_files.make_dir(paths.dir)
    precious = tmp_path / "precious"
    precious.write_text("keys of ours\n")
    planted = tmp_path / "planted"
    planted.mkdir()
    os.symlink(precious, planted / "rank-0.lock")
    for p in (planted, planted / "rank-0.lock"):
        os.lchown(p, NOBODY, NOBODY)
    swapped = _swap_after(monkeypatch, 1, paths.dir, lambda: planted.rename(paths.dir))
    try:
        staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    except (LayoutError, OSError):
        pass
    monkeypatch.undo()
    assert swapped
    assert precious.read_text() == "keys of ours\n", "the stager wrote through the planted folder's symlink"
    assert sorted(p.name for p in paths.dir.iterdir()) == ["rank-0.lock"], "the stager wrote into the planted folder"
    moved = paths.dir.with_name("checked-and-moved")  # the checked folder got the copy
    assert shm_files.read_ready(moved / "rank-0.ready").nbytes == (moved / "rank-0.img").stat().st_size


def test_symlinks_pipes_and_devices_in_a_staged_files_place_are_refused_by_name(image, tmp_path):
    """A staging folder that is a symlink, and a .ready or image that is a symlink, a named pipe
    or a device, are refused by name (LayoutError), never followed, waited on or read."""
    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = staged_paths(image, 0, shm)
    elsewhere = tmp_path / "elsewhere"
    paths.dir.rename(elsewhere)
    os.symlink(elsewhere, paths.dir)
    with pytest.raises(LayoutError, match=f"{paths.dir} is a symlink"):
        shm_files.read_ready(paths.ready)
    paths.dir.unlink()
    elsewhere.rename(paths.dir)

    (tmp_path / "ready-copy").write_bytes(paths.ready.read_bytes())
    paths.ready.unlink()
    os.symlink(tmp_path / "ready-copy", paths.ready)
    with pytest.raises(LayoutError, match=f"{paths.ready}: a symlink where a staged file should be"):
        shm_files.read_ready(paths.ready)
    paths.ready.unlink()
    (tmp_path / "ready-copy").rename(paths.ready)

    keep = tmp_path / "img-copy"
    paths.image.rename(keep)
    makers = [(lambda p: os.symlink(keep, p), "a symlink"), (os.mkfifo, "a named pipe")]
    if os.geteuid() == 0:  # /dev/zero's numbers: a read that never ends
        makers.append((lambda p: os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 5)), "a character device"))
    for make, kind in makers:
        make(paths.image)
        with pytest.raises(LayoutError, match=f"{paths.image}: {'a symlink' if kind == 'a symlink' else f'not a regular file .{kind}'}"):
            shm_files.open_staged(paths, os.O_RDWR)
        with pytest.raises(LayoutError):
            flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=5, stream=False)
        paths.image.unlink()
    keep.rename(paths.image)
    info, fd = shm_files.open_staged(paths, os.O_RDWR)
    os.close(fd)
    assert info.nbytes == paths.image.stat().st_size


def test_a_symlink_at_the_staging_folders_name_is_neither_staged_into_nor_unstaged_through(image, tmp_path):
    """Defect: an engine staging its own copy (``stage_for_load``) opened ``rank-R.users`` by path,
    through a symlink at the staging folder's name, and so made it (and, before the stager opened
    its folder without following links, staged the whole copy) in the folder the link named; and
    ``unstage`` listed that folder and removed its ``rank-*`` files, whatever they were. Now both
    refuse the link by name and touch nothing behind it."""
    shm = tmp_path / "shm"
    paths = staged_paths(image, 0, shm)
    target = tmp_path / "ours"
    target.mkdir(mode=0o755)
    (target / "rank-0.keep").write_text("not a staged file\n")
    shm.mkdir()
    os.symlink(target, paths.dir)
    with pytest.raises(LayoutError, match=f"{paths.dir} is a symlink"):
        staging.stage_for_load(image, 0, timeout_s=5, shm_dir=shm)
    assert sorted(os.listdir(target)) == ["rank-0.keep"]
    with pytest.raises(LayoutError, match=f"{paths.dir} is a symlink"):
        staging.unstage(image, shm_dir=shm)
    assert (target / "rank-0.keep").read_text() == "not a staged file\n"


def test_status_says_what_a_load_would_find_not_what_the_ready_file_claims(image, tmp_path):
    """Defect: ``preload --status`` sized the staged image by its path, following a symlink (or
    a pipe) in its place, and said "staged" of a copy every load refuses; and it named the
    path the ``.ready`` claims the copy was written to, not the one loads read."""
    from flashboot.flashload.status import rank_states

    shm = tmp_path / "shm"
    staging.stage_rank(image, 0, shm_dir=shm, threads=2, chunk_bytes=8192)
    paths = staged_paths(image, 0, shm)
    ready = paths.ready.read_text().replace(str(paths.image), "/somewhere/else.img")
    paths.ready.write_text(ready)
    (state,) = rank_states(image, [0], shm)
    assert state.state == "staged" and f"at {paths.image} (" in state.detail, state
    keep = tmp_path / "img-copy"
    paths.image.rename(keep)
    os.symlink(keep, paths.image)
    (state,) = rank_states(image, [0], shm)
    assert state.state == "unreadable" and f"{paths.image}: a symlink" in state.detail, state
    with pytest.raises(LayoutError, match="a symlink"):  # as the load says
        flashboot.load(image, 0, "cpu", shm_dir=shm, timeout_s=5, stream=False)


@needs_root
@pytest.mark.parametrize("name", ["preload.pid", "preload.log"])
def test_a_preloader_never_writes_its_pid_or_log_through_another_users_folder(image, tmp_path, name):
    """Defect: a preloader opened its pid file (O_CREAT, then truncated and wrote its JSON) and a
    background one its log (append) by path, before anything checked their folder: another
    user who made the image's staging folder first (its name is the image path's hash), with a
    ``preload.pid`` or ``preload.log`` symlink in it, had ``flashboot preload`` overwrite or
    append to any file of ours the link named. Now the folder is checked and opened first, and
    the file opened in it without following a link."""
    from flashboot.flashload import service

    shm = tmp_path / "shm"
    folder = shm_files.staging_dir(image, shm)
    folder.mkdir(parents=True)
    precious = tmp_path / "precious"
    precious.write_text("keys of ours\n")
    os.symlink(precious, folder / name)
    os.chown(folder, NOBODY, NOBODY)
    os.lchown(folder / name, NOBODY, NOBODY)
    config = staging.PreloadConfig(str(image), shm_dir=str(shm))
    with pytest.raises(LayoutError, match=f"{folder} belongs to uid {NOBODY}"):
        if name == "preload.pid":
            service.run_service(config, log=lambda line: None)
        else:
            service.start_background(config, timeout_s=30)
    assert precious.read_text() == "keys of ours\n"
