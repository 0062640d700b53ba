"""The checksum kernel compiled ahead of time: its cache entry (what a launch needs, staleness,
corruption) on the host, where Triton compiles for sm_90 without a GPU; and on a GPU, launches
without Triton whose digests are bit-identical to Triton's own launch."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from flashboot.errors import FlashBootError, KernelCacheError
from flashboot.kernels import checksum_gpu, cubin

pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend compiles the cubin")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHBOOT_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(checksum_gpu, "_launchers", {})
    return tmp_path / "kernels"


def _key(copy=False, arch=90):
    return checksum_gpu.words_kernel_key(arch, checksum_gpu._gpu_knobs({}), copy)


def _compile(code: str, cache=None) -> str:
    """Run ``code`` (Triton compiling for sm_90) in a fresh interpreter: this one may run Triton's
    interpreter (no GPU), whose kernels cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache is not None:
        env["FLASHBOOT_KERNEL_CACHE"] = str(cache)
    p = subprocess.run([sys.executable, "-c", "from flashboot.kernels import checksum_gpu as g\n" + code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _build(cache, copy=False, source_sha256=None):
    """Build the word kernel's entry for sm_90 (as built for ``source_sha256`` when given)."""
    _compile(f"import dataclasses\nkey = g.words_kernel_key(90, g._gpu_knobs({{}}), {copy})\n"
             f"if {source_sha256!r}: key = dataclasses.replace(key, source_sha256={source_sha256!r})\n"
             "g._build_words_cubin(key)", cache)
    return cubin.load(dataclasses.replace(_key(copy), source_sha256=source_sha256 or _key(copy).source_sha256))[0]


def test_cached_entry_records_what_a_launch_needs(cache):
    key = _key()
    loaded = _build(cache)
    assert loaded.path == key.path() and loaded.path.parent == cache and loaded.cubin[:4] == b"\x7fELF"
    # the runtime arguments in the kernel's order: the constexprs BLOCK and COPY are compiled in
    assert [n for n, _ in loaded.params] == ["words_ptr", "sums_ptr", "copy_ptr", "n_words", "chunk_words",
                                             "start_word", "tiles_per_chunk", "n_tiles"]
    assert [t for _, t in loaded.params] == ["*i32", "*i64", "*i32"] + ["i64"] * 5
    assert loaded.num_warps == checksum_gpu.CHECKSUM_TUNING["num_warps"] and loaded.function == "checksum_words_kernel"
    # Triton >= 3.5 appends a global and a profile scratch pointer to every kernel's parameters
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    assert loaded.scratch_pointers == (2 if (major, minor) >= (3, 5) else 1)
    assert key.triton == triton.__version__ and key.arch == 90


def test_the_cubin_loads_full_tiles_as_16_byte_vectors():
    """The specialisation the cache key names is what makes the loads (and the copy's stores)
    16-byte vectors; without it the kernel reads word by word."""
    out = _compile("import re\nfrom flashboot.kernels.checksum_triton import compile_words_kernel\n"
                   "for d in (g.WORDS_ALIGNED_ARGS, ()):\n"
                   "    ptx = compile_words_kernel(90, block=1024, copy=True, num_warps=4, num_stages=3, divisible_by_16=d).asm['ptx']\n"
                   "    print(sorted(set(re.findall(r'[ls][dt]\\.global\\.v4', ptx))))")
    aligned, plain = out.strip().splitlines()
    assert aligned == "['ld.global.v4', 'st.global.v4']"
    assert plain == "[]"


def test_a_stale_entry_is_refused_and_rebuilt(cache):
    _build(cache, source_sha256="0" * 64)  # built before the kernel's source changed
    found, why = cubin.load(_key())
    assert found is None
    assert "stale cubin" in why and "source sha256 000000000000" in why and _key().source_sha256[:12] in why
    assert _build(cache) is not None  # rebuilt in place for the current source
    assert cubin.load(_key())[0] is not None


def test_a_corrupt_cubin_raises_with_the_numbers(cache):
    key = _key(copy=True)
    built = _build(cache, copy=True)
    path = built.path / "kernel.cubin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(KernelCacheError, match=f"{path}: corrupt cubin: {len(raw):,} bytes with sha256"):
        cubin.load(key)
    path.write_bytes(bytes(raw[:1000]))
    with pytest.raises(KernelCacheError, match=f"1,000 bytes .* expects {len(raw):,} bytes"):
        cubin.load(key)
    (built.path / "entry.json").write_text("{not json")
    with pytest.raises(KernelCacheError, match="unreadable kernel cache entry"):
        cubin.load(key)


def test_a_launch_with_the_wrong_arguments_is_refused_before_the_driver(cache):
    launcher = cubin.CubinLauncher(_build(cache))
    with pytest.raises(FlashBootError, match="3 arguments for its 8 parameters"):
        launcher.launch((1,), (0, 0, 0), device=0, stream=0)


def test_loading_the_gpu_checksum_imports_no_triton():
    code = ("import sys; import flashboot.kernels.checksum_gpu as g, flashboot.kernels.copy_verify, "
            "flashboot.kernels.cubin as c; g.words_kernel_key(90, g._gpu_knobs({}), False); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'cupy', 'numba'}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------ real GPU
@pytest.mark.gpu
@pytest.mark.parametrize("copy", [False, True])
def test_cubin_digests_are_bit_identical_to_tritons(cache, copy):
    import torch

    from flashboot.memory import span_of

    knobs = checksum_gpu._gpu_knobs({})
    n = (256 << 20) + 4 * 37  # a last chunk that is not whole tiles
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    for chunk_bytes, start_word in ((64 << 20, 0), (1 << 14, 0), (4160, 0), (1 << 20, (1 << 32) - 1024 * 8)):
        out = {}
        for via in ("triton", "cubin"):
            dst = torch.zeros_like(src) if copy else None
            pending = checksum_gpu._start_chunk_sums(span_of(src), chunk_bytes, None, knobs, start_word,
                                                     copy_to=span_of(dst) if copy else None, via=via)
            out[via] = pending.digests()
            if copy:
                assert torch.equal(dst, src)
        assert out["cubin"] == out["triton"], (chunk_bytes, start_word)
    host = src.cpu().numpy()
    from flashboot.kernels.checksum_host import chunk_checksums_host

    assert checksum_gpu.device_chunk_checksums(span_of(src), 1 << 20) == chunk_checksums_host(host, 1 << 20)


@pytest.mark.gpu
def test_a_fresh_process_checksums_from_the_cubin_without_triton(cache):
    """After the early call built the cubin, a fresh process's first checksum imports no Triton."""
    checksum_gpu.prepare_checksum_kernels(0)
    code = """
import sys, numpy as np, torch
from flashboot.kernels.checksum import chunk_checksums
t = torch.arange(1 << 22, dtype=torch.int32, device="cuda").view(torch.uint8)
print(chunk_checksums(t, 1 << 20))
print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'cupy'}))
"""
    env = {**os.environ, "FLASHBOOT_KERNEL_CACHE": str(cache)}
    p = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    digests, modules = p.stdout.strip().splitlines()
    from flashboot.kernels.checksum_host import chunk_checksums_host

    host = np.arange(1 << 22, dtype=np.int32).view(np.uint8)
    assert digests == str(chunk_checksums_host(host, 1 << 20))
    assert modules == "[]"


@pytest.mark.gpu
def test_the_sm_count_from_the_driver_is_torchs():
    """The launch grids' SM count is one driver attribute; it must agree with torch's device properties."""
    import torch

    from flashboot.kernels.views import sm_count

    for index in range(torch.cuda.device_count()):
        assert sm_count(index) == torch.cuda.get_device_properties(index).multi_processor_count
