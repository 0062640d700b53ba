"""A file that FlashBoot reads whole (an image's tables, a checkpoint's JSON, a token), replaced
by a named pipe or a device, or grown past what such a file holds, is refused by name: a plain
``open`` of a pipe waits for a writer forever, a read of ``/dev/zero`` never ends, and a sparse
file of many GB reads as that much memory (fileio.open_regular)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from _io_helpers import image, image_master  # noqa: F401  (fixtures)

from flashboot.errors import LayoutError, RendezvousError
from flashboot.flashclone.records import resolve_token
from flashboot.layouts import read_image
from flashboot.layouts.checkpoint import read_safetensors_header
from flashboot.layouts.table import TABLE_FILE

pytestmark = pytest.mark.timeout(120)


def _outcome(call, timeout_s: float = 10.0):
    """``call()``'s result or error, from a daemon thread: a call that blocks fails the test
    instead of hanging it."""
    out = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:  # handed to the assertions
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"the call was still blocked after {timeout_s:g} s"
    return out[0]


def _replace_with_fifo(path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_an_images_table_replaced_by_a_named_pipe_is_refused(image):
    table = image / "rank-0" / TABLE_FILE
    _replace_with_fifo(table)
    got = _outcome(lambda: read_image(image))
    assert isinstance(got, LayoutError), got
    assert str(got) == f"{table}: not a regular file (a named pipe)"


def test_an_images_table_linked_to_dev_zero_is_refused(image):
    table = image / "rank-0" / TABLE_FILE
    table.unlink()
    table.symlink_to("/dev/zero")
    got = _outcome(lambda: read_image(image))
    assert isinstance(got, LayoutError), got
    assert str(got) == f"{table}: not a regular file (a character device)"


def test_inspect_of_such_an_image_says_why_and_exits(image):
    _replace_with_fifo(image / "rank-0" / TABLE_FILE)
    run = subprocess.run([sys.executable, "-m", "flashboot.cli", "inspect", str(image)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert "tensors.bin: not a regular file (a named pipe)" in run.stderr


def test_a_checkpoint_shard_that_is_a_named_pipe_is_refused(tmp_path):
    shard = tmp_path / "model.safetensors"
    os.mkfifo(shard)
    got = _outcome(lambda: read_safetensors_header(shard))
    assert isinstance(got, LayoutError), got
    assert str(got) == f"{shard}: not a regular file (a named pipe)"


def test_a_token_file_that_is_a_named_pipe_is_refused(tmp_path):
    token = tmp_path / "token"
    os.mkfifo(token)
    got = _outcome(lambda: resolve_token(token_file=token))
    assert isinstance(got, RendezvousError), got
    assert str(got) == f"{token}: not a regular file (a named pipe)"


def test_a_regular_table_still_reads(image):
    assert read_image(image).table_source == TABLE_FILE


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_checkpoints_json_that_is_a_named_pipe_is_refused(tmp_path, name):
    from flashboot.layouts.checkpoint import open_checkpoint

    os.mkfifo(tmp_path / name)
    got = _outcome(lambda: open_checkpoint(tmp_path))
    assert isinstance(got, LayoutError), got
    assert str(got) == f"{tmp_path / name}: not a regular file (a named pipe)"


def test_an_images_table_of_many_gb_is_refused_before_it_is_read(image):
    from flashboot.layouts.image import MAX_TABLE_FILE_BYTES

    table = image / "rank-0" / TABLE_FILE
    os.truncate(table, MAX_TABLE_FILE_BYTES + 4096)  # sparse: no disk used, but read whole it is 1 GiB of memory
    got = _outcome(lambda: read_image(image))
    assert isinstance(got, LayoutError), got
    assert str(got) == (f"{table}: {MAX_TABLE_FILE_BYTES + 4096:,} bytes, more than the {MAX_TABLE_FILE_BYTES:,} "
                        "this file may hold (damaged, or not what it is named?)")


def test_a_metadata_file_of_many_gb_is_refused_before_it_is_read(image):
    from flashboot.layouts.format import METADATA_FILE
    from flashboot.layouts.image import MAX_TABLE_FILE_BYTES

    meta = image / "rank-0" / METADATA_FILE
    os.truncate(meta, 4 * MAX_TABLE_FILE_BYTES)
    got = _outcome(lambda: read_image(image))
    assert isinstance(got, LayoutError), got
    assert f"{meta}: {4 * MAX_TABLE_FILE_BYTES:,} bytes, more than the {MAX_TABLE_FILE_BYTES:,}" in str(got)


def test_a_token_file_over_a_mib_is_refused(tmp_path):
    from flashboot.flashclone.records import MAX_TOKEN_FILE_BYTES

    token = tmp_path / "token"
    token.write_bytes(b"x" * (MAX_TOKEN_FILE_BYTES + 1))
    got = _outcome(lambda: resolve_token(token_file=token))
    assert isinstance(got, RendezvousError), got
    assert f"{token}: {MAX_TOKEN_FILE_BYTES + 1:,} bytes, more than the {MAX_TOKEN_FILE_BYTES:,}" in str(got)


def test_a_token_file_grown_after_its_size_check_is_refused_not_read_whole(tmp_path, monkeypatch):
    """The size is checked on the open fd; a file that grows after that check (a sparse extension
    to many GB) was read whole all the same."""
    from flashboot import fileio
    from flashboot.flashclone.records import MAX_TOKEN_FILE_BYTES

    token = tmp_path / "token"
    token.write_bytes(b"x" * 64)
    real = fileio.open_regular

    def open_then_grow(path, *args, **kwargs):
        f = real(path, *args, **kwargs)
        os.truncate(path, 64 * MAX_TOKEN_FILE_BYTES)  # sparse: no disk used
        return f

    monkeypatch.setattr(fileio, "open_regular", open_then_grow)
    got = _outcome(lambda: resolve_token(token_file=token))
    assert isinstance(got, RendezvousError), got
    assert str(got) == f"{token}: grew past the {MAX_TOKEN_FILE_BYTES:,} bytes this file may hold while it was read"


def test_a_read_past_a_shrunken_files_end_names_where_it_ends(tmp_path):
    """A reader of a later piece finds the end of a file that shrank past its own offset: the
    error names the byte the file ends at, not the piece's offset (106,496 for a 100,000-byte file)."""
    import os

    from flashboot.errors import LayoutError
    from flashboot.fileio import read_exactly

    path = tmp_path / "image.bin"
    path.write_bytes(b"\1" * 100_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(LayoutError, match=r"ends at byte 100,000; 200,000 bytes were expected"):
            read_exactly(fd, memoryview(bytearray(4096)), 106_496, 4096, direct=False, path=str(path),
                         file_nbytes=200_000)
    finally:
        os.close(fd)
