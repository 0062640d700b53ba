"""Hardening of the kernel cache, the units, the host checksum, the CLI's output and the benchmarks'
arguments: each test reproduces a defect found by an audit (host backend, no GPU)."""

from __future__ import annotations

import json
import os
import warnings
from types import SimpleNamespace

import pytest

from flashboot.errors import KernelCacheError
from flashboot.kernels import checksum_gpu, cubin


# --- kernel cache -------------------------------------------------------------------------------
def _fake_compiled(size=1000):
    """What cubin.save reads of Triton's CompiledKernel, without Triton."""
    return SimpleNamespace(
        metadata=SimpleNamespace(name="checksum_words_kernel", num_warps=4, shared=0, global_scratch_size=0),
        asm={"cubin": b"\x7fELF" + b"x" * size},
        src=SimpleNamespace(signature={"words_ptr": "*i32", "n": "i64"}, constants={}))


@pytest.fixture
def kcache(tmp_path, monkeypatch):
    """A kernel cache in tmp_path, a fake sm_90 device, and a 'compiler' that saves a fake cubin
    and counts its builds (the driver's module load is not reached: launcher.function is faked)."""
    monkeypatch.setenv("FLASHBOOT_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(checksum_gpu, "_launchers", {})
    monkeypatch.setattr(checksum_gpu, "compute_capability", lambda dev: 90)
    builds = []

    def build(key):
        builds.append(key)
        return cubin.save(key, _fake_compiled())

    monkeypatch.setattr(checksum_gpu, "_build_words_cubin", build)
    monkeypatch.setattr(cubin.CubinLauncher, "function", lambda self, device: 1)
    return SimpleNamespace(root=tmp_path / "kernels", builds=builds,
                           key=checksum_gpu.words_kernel_key(90, checksum_gpu._gpu_knobs({}), False))


def test_a_truncated_cubin_is_discarded_and_rebuilt(kcache):
    entry = cubin.save(kcache.key, _fake_compiled())
    (entry.path / "kernel.cubin").write_bytes((entry.path / "kernel.cubin").read_bytes()[:10])
    with pytest.raises(KernelCacheError):
        cubin.load(kcache.key)
    with pytest.warns(RuntimeWarning, match="corrupt cubin.*discarding it and rebuilding"):
        checksum_gpu.prepare_checksum_kernels(0)
    # rebuilt: the entry loads again, and a second process start finds it good (no rebuild)
    assert kcache.key in kcache.builds
    assert cubin.load(kcache.key)[0].cubin == _fake_compiled().asm["cubin"]
    checksum_gpu._launchers.clear()
    n = len(kcache.builds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checksum_gpu.prepare_checksum_kernels(0)
    assert len(kcache.builds) == n


@pytest.mark.parametrize("edit,match", [
    (lambda e: e.pop("function"), "'function'"),
    (lambda e: e.update(params=5), "'params'"),
    (lambda e: e.update(num_warps=None), "'num_warps'"),
    (lambda e: e.update(params=[["a", "bogus"]]), "'params'"),
    (lambda e: e.update(shared=-1), "'shared'"),
])
def test_a_malformed_entry_field_is_a_kernel_cache_error(kcache, edit, match):
    entry = cubin.save(kcache.key, _fake_compiled())
    path = entry.path / "entry.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))  # key and sha still match: only the launch field is wrong
    with pytest.raises(KernelCacheError, match=f"unreadable kernel cache entry.*{match}"):
        cubin.load(kcache.key)


def test_an_entry_with_an_infinite_size_is_a_kernel_cache_error(kcache):
    entry = cubin.save(kcache.key, _fake_compiled())
    path = entry.path / "entry.json"
    path.write_text(path.read_text().replace('"cubin_bytes": 1004', '"cubin_bytes": 1e400'))
    with pytest.raises(KernelCacheError, match="OverflowError"):
        cubin.load(kcache.key)


def test_save_syncs_before_the_rename_and_leaves_no_temp_file_on_failure(kcache, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(len(synced)), real_replace(a, b)))
    entry = cubin.save(kcache.key, _fake_compiled())
    # each file synced before its rename, and the directory after both
    assert renamed == [1, 2] and len(synced) == 3

    def full_disk(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cubin.save(kcache.key, _fake_compiled())
    assert sorted(p.name for p in entry.path.iterdir()) == ["entry.json", "kernel.cubin"]


# --- host checksum ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [1 << 40, 1 << 60, 1 << 70, 12, 13])
@pytest.mark.parametrize("data", [bytes(8), bytes(range(11))])
def test_a_chunk_larger_than_the_buffer_is_one_digest_of_it(data, chunk_bytes):
    # the scratch was sized by chunk_bytes: 1<<60 raised MemoryError, 1<<70 OverflowError
    from flashboot.kernels.checksum_host import chunk_checksums_host
    from flashboot.kernels.checksum_spec import checksum_reference

    assert chunk_checksums_host(data, chunk_bytes) == [checksum_reference(data)]
    assert chunk_checksums_host(b"", chunk_bytes) == []


# --- benchmark arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["movers", "--repeats", "0", "--paths", "host", "--sizes", "4KiB"], "repeats must be an int >= 1, got 0"),
    (["movers", "--paths", "bogus"], "unknown path 'bogus'; known: d2d, d2h, h2d, host, p2p"),
    (["movers", "--paths", "host", "--movers", "bogus"], "unknown mover 'bogus'; known: "),
    (["arena", "--repeats", "0", "--device", "cpu", "--size", "1MiB"], "repeats must be an int >= 1, got 0"),
    (["clone", "--device", "cpu", "--clones", "0"], "--clones must be an int >= 1, got 0"),
    (["clone", "--device", "cpu", "--repeats", "0"], "--repeats must be an int >= 1, got 0"),
    (["clone", "--device", "cpu", "--timeout", "nan"], "--timeout must be a finite number of seconds"),
    (["clone", "--device", "cpu", "--timeout", "-5"], "--timeout must be a finite number of seconds"),
])
def test_bench_refuses_arguments_that_measure_nothing(argv, message, capsys):
    # these had ended in statistics' empty-median traceback, 'Bad file descriptor', or an empty
    # table with exit 0
    from flashboot.cli import main

    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_movers_that_measured_nothing_exits_non_zero(monkeypatch, capsys):
    # a path no available mover copies (h2d without a GPU) gave an empty table and exit 0
    import flashboot.movers as registry  # what the benchmark imports list_movers from
    from flashboot.benchmarks import movers
    from flashboot.cli import main

    real = registry.list_movers
    monkeypatch.setattr(registry, "list_movers",
                        lambda: [m for m in real() if "h2d" not in m.paths or not m.available])
    monkeypatch.setattr(movers, "_endpoints", lambda path, n: pytest.fail("nothing to measure, yet it set up"))
    assert main(["bench", "movers", "--paths", "h2d", "--sizes", "4KiB"]) == 2
    assert "nothing measured: no available mover copies on path(s) h2d" in capsys.readouterr().err


# --- outside JSON -------------------------------------------------------------------------------
def test_a_field_nested_as_deep_as_loads_accepts_is_named_not_a_recursion_error():
    from flashboot._json import check_fields, is_str, loads
    from flashboot.errors import FlashBootError

    def parse(d):
        return loads('{"name": ' + "[" * d + "]" * d + "}", "request")

    lo, hi = 1, 100_000  # the deepest nesting loads() accepts here, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            parse(mid)
            lo = mid
        except FlashBootError:
            hi = mid - 1
    value = parse(lo)

    def from_a_handler(frames):  # a server checks fields a few calls down its stack
        if frames:
            return from_a_handler(frames - 1)
        check_fields(value, {"name": ("a string", is_str)}, FlashBootError, "load request: ")

    # str() of the whole value first had raised RecursionError
    with pytest.raises(FlashBootError, match=r"load request: name must be a string, found \[\[\[\[\[?\.\.\.\]") as info:
        from_a_handler(20)
    assert len(str(info.value)) < 300
