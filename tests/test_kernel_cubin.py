"""The checksum kernel compiled ahead of time: its cache entry (what a launch needs, staleness,
corruption) on the host, where Triton compiles for sm_90 without a GPU; and on a GPU, launches
without Triton whose digests are bit-identical to Triton's own launch."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from _python import run_compiling
from flashboot.errors import CapabilityError, CudaError, FlashBootError, KernelCacheError
from flashboot.kernels import checksum_gpu, cubin, launch_ctypes

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
    return run_compiling("from flashboot.kernels import checksum_gpu as g\n" + code, timeout=300,
                         env=None if cache is None else {"FLASHBOOT_KERNEL_CACHE": str(cache)})


def _build(cache, copy=False, source_sha256=None):
    """Build the word kernel's entry for sm_90 (as built for ``source_sha256`` when given)."""
    _compile(f"key = g.words_kernel_key(90, g._gpu_knobs({{}}), {copy})\n"
             f"if {source_sha256!r}: key = key._replace(source_sha256={source_sha256!r})\n"
             "g._build_words_cubin(key)", cache)
    return cubin.load(_key(copy)._replace(source_sha256=source_sha256 or _key(copy).source_sha256))[0]


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


class FakeDriver:
    """The driver calls of launch_ctypes as Python callables behind the same C prototypes: records
    what a cubin's load and launch ask of the driver, and fails a call with a given CUresult."""

    ERRORS = {200: (b"CUDA_ERROR_INVALID_IMAGE", b"device kernel image is invalid")}
    ATTRIBUTES = {16: 132, 75: 9, 76: 0}  # an H200: 132 SMs, sm_90

    def __init__(self, current=0):
        self.current, self.fail = current, {}
        self.contexts_set, self.loaded, self.launches = [], [], []

    def bind(self):
        return launch_ctypes.bind({name: getattr(self, name) for name in launch_ctypes.PROTOTYPES})

    def cuInit(self, flags):
        return 0

    def cuGetErrorName(self, code, out):
        if code not in self.ERRORS:
            return 1  # CUDA_ERROR_INVALID_VALUE: a code the driver does not know
        out[0] = self.ERRORS[code][0]
        return 0

    def cuGetErrorString(self, code, out):
        if code not in self.ERRORS:
            return 1
        out[0] = self.ERRORS[code][1]
        return 0

    def cuDeviceGet(self, out, ordinal):
        out[0] = ordinal
        return 0

    def cuDeviceGetAttribute(self, out, attribute, device):
        out[0] = self.ATTRIBUTES[attribute]
        return 0

    def cuDevicePrimaryCtxRetain(self, out, device):
        out[0] = 0x1000 + device
        return 0

    def cuCtxGetCurrent(self, out):
        out[0] = self.current
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.contexts_set.append(ctx or 0)
        self.current = ctx or 0
        return 0

    def cuModuleLoadData(self, out, image):
        self.loaded.append((image[:4], self.current))
        out[0] = 0x2000
        return self.fail.get("cuModuleLoadData", 0)

    def cuModuleGetFunction(self, out, module, name):
        out[0] = 0x3000 if (module, name) == (0x2000, b"checksum_words_kernel") else 0x3001
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # decoded here: the values the params point at live only during the call
        self.launches.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
                              "stream": stream, "extra": extra, "params": params,
                              "values": [t.from_address(p).value for t, p in
                                         zip(self.param_types, (ctypes.c_void_p * len(self.param_types)).from_address(params))]})
        return self.fail.get("cuLaunchKernel", 0)


@pytest.fixture
def fake_driver(monkeypatch):
    fake = FakeDriver(current=0xBEEF)  # the caller's own context: another device's
    bound = fake.bind()
    monkeypatch.setattr(launch_ctypes, "_driver", lambda: bound)
    monkeypatch.setattr(launch_ctypes, "_primary_contexts", {})
    launch_ctypes.sm_count.cache_clear()
    launch_ctypes.compute_capability.cache_clear()
    yield fake
    launch_ctypes.sm_count.cache_clear()
    launch_ctypes.compute_capability.cache_clear()


def test_a_cubin_launch_passes_tritons_grid_block_and_arguments(cache, fake_driver):
    """cuLaunchKernel gets what Triton's launcher passes: the grid, 32 x num_warps threads, the
    metadata's shared memory, the stream, each argument as its 64-bit type, then a null pointer
    per scratch buffer; the cubin is loaded once, in the device's primary context, and the
    caller's context is current again afterwards."""
    built = _build(cache)
    launcher = cubin.CubinLauncher(built)
    fake_driver.param_types = [ctypes.c_uint64] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_uint64] * built.scratch_pointers
    args = (0x7F00_0000_1000, 0x7F00_0000_2000, 0x7F00_0000_3000, (1 << 33) + 5, 4096, (1 << 32) - 8192, 3, -1)
    launcher.launch((264,), args, device=0, stream=0x5000)
    launcher.launch((7, 2), args, device=0, stream=0)
    first, second = fake_driver.launches
    assert first["values"] == [*args, *[0] * built.scratch_pointers]
    assert first["grid"] == (264, 1, 1) and second["grid"] == (7, 2, 1)
    assert first["block"] == (32 * built.num_warps, 1, 1) and first["shared"] == built.shared
    assert (first["stream"], second["stream"]) == (0x5000, None)  # None: ctypes' NULL, the legacy stream
    assert first["function"] == 0x3000 and first["extra"] is None
    assert fake_driver.loaded == [(b"\x7fELF", 0x1000)]  # once, in cuda:0's primary context
    assert fake_driver.contexts_set == [0x1000, 0xBEEF] and fake_driver.current == 0xBEEF


def test_a_launch_packs_each_type_as_its_c_type(fake_driver, tmp_path):
    key = cubin.KernelKey("k", "0" * 64, 90, "3.6.0", "v", {})
    params = (("p", "*i8"), ("a", "i32"), ("b", "u16"), ("c", "fp32"), ("d", "fp64"), ("e", "u64"))
    launcher = cubin.CubinLauncher(cubin.CachedKernel(key, tmp_path, b"\x7fELF", "k", params, 8, 1024, 1))
    fake_driver.param_types = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint16, ctypes.c_float, ctypes.c_double,
                               ctypes.c_uint64, ctypes.c_uint64]
    launcher.launch((1,), (0xABC0, -7, 65535, 0.5, -2.25, (1 << 64) - 1), device=3, stream=1)
    (launch,) = fake_driver.launches
    assert launch["values"] == [0xABC0, -7, 65535, 0.5, -2.25, (1 << 64) - 1, 0]
    assert launch["block"] == (256, 1, 1) and launch["shared"] == 1024 and launch["function"] == 0x3001
    assert fake_driver.contexts_set == [0x1003, 0xBEEF]
    launcher.launch((0,), (0, 0, 0, 0.0, 0.0, 0), device=3, stream=1)  # an empty grid launches nothing
    assert len(fake_driver.launches) == 1


def test_driver_errors_name_the_call_and_the_drivers_error(fake_driver, tmp_path):
    key = cubin.KernelKey("k", "0" * 64, 90, "3.6.0", "v", {})
    launcher = cubin.CubinLauncher(cubin.CachedKernel(key, tmp_path, b"\x7fELF", "k", (("n", "i32"),), 4, 0, 0))
    fake_driver.param_types = [ctypes.c_int32]
    fake_driver.fail["cuModuleLoadData"] = 200
    with pytest.raises(CudaError, match=rf"cuModuleLoadData\({tmp_path}/kernel.cubin on cuda:0\) failed with "
                                        r"CUDA_ERROR_INVALID_IMAGE \(200\): device kernel image is invalid"):
        launcher.launch((1,), (5,), device=0, stream=0)
    assert fake_driver.current == 0xBEEF  # the caller's context restored on the error too
    fake_driver.fail = {"cuLaunchKernel": 999}
    with pytest.raises(CudaError, match=r"cuLaunchKernel\(k, grid 2x1x1\) failed with unknown CUresult \(999\)$") as err:
        launcher.launch((2,), (5,), device=0, stream=0)
    assert (err.value.code, err.value.name) == (999, "unknown CUresult")


def test_a_thread_without_a_context_keeps_the_devices(fake_driver):
    fake_driver.current = 0
    assert launch_ctypes.load_function(b"\x7fELF", "checksum_words_kernel", 1, "x.cubin") == 0x3000
    assert fake_driver.contexts_set == [0x1001] and fake_driver.current == 0x1001


def test_the_device_attributes_are_the_drivers_numbers(fake_driver):
    from cuda.bindings import driver

    attr = driver.CUdevice_attribute
    assert launch_ctypes.MULTIPROCESSOR_COUNT == int(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    assert launch_ctypes.COMPUTE_CAPABILITY_MAJOR == int(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
    assert launch_ctypes.COMPUTE_CAPABILITY_MINOR == int(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
    assert (launch_ctypes.sm_count(0), launch_ctypes.compute_capability(0)) == (132, 90)


def test_a_library_without_the_driver_calls_is_a_capability_error(monkeypatch):
    libc = ctypes.CDLL("libc.so.6")  # a real library, without cuInit and the others
    launch_ctypes._driver.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    with pytest.raises(CapabilityError, match="libcuda.so.1 lacks a driver call the kernel launch needs .*cuInit"):
        launch_ctypes.device_attribute(0, launch_ctypes.MULTIPROCESSOR_COUNT)
    launch_ctypes._driver.cache_clear()


def test_no_driver_library_is_a_capability_error(monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    launch_ctypes._driver.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(CapabilityError, match="no CUDA driver on this machine: libcuda.so.1 cannot be loaded"):
        launch_ctypes.device_attribute(0, launch_ctypes.MULTIPROCESSOR_COUNT)
    launch_ctypes._driver.cache_clear()


def test_the_first_calls_key_and_entry_need_neither_triton_nor_cuda_bindings(cache):
    """A fresh process's first checksum computes the cache key (Triton's version read from its
    installed package) and reads the entry without importing Triton, cupy, numba, cuda.bindings
    (17.5 ms on an H200 host) or kernels.launch (Triton launches' cache: milliseconds of imports)."""
    _build(cache)
    code = ("import sys; import flashboot.kernels.checksum_gpu as g, flashboot.kernels.copy_verify, "
            "flashboot.kernels.cubin as c\nkey = g.words_kernel_key(90, g._gpu_knobs({}), False)\n"
            "entry, why = c.load(key); assert entry is not None, why\nprint(key.triton)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'cupy', 'numba'} | "
            "{'cuda.bindings', 'flashboot.kernels.launch'} & set(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FLASHBOOT_KERNEL_CACHE": str(cache)})
    assert p.returncode == 0, p.stderr[-2000:]
    from importlib.metadata import version

    assert p.stdout.split() == [version("triton"), "[]"]


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
    """After the early call built the cubin, a fresh process's first checksum imports neither
    Triton nor cuda.bindings (the driver through ctypes)."""
    checksum_gpu.prepare_checksum_kernels(0)
    code = """
import sys, numpy as np, torch
t = torch.arange(1 << 22, dtype=torch.int32, device="cuda").view(torch.uint8)
before = set(sys.modules)  # some torch builds import cuda.bindings themselves: what the checksum adds counts
from flashboot.kernels.checksum import chunk_checksums
print(chunk_checksums(t, 1 << 20))
added = set(sys.modules) - before
print(sorted({m for m in added if m.split('.')[0] in ('triton', 'cupy')} | {'cuda.bindings'} & added))
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
    """The launch grids' SM count and the cubin's arch are driver attributes; they must agree with torch's."""
    import torch

    from flashboot.kernels.views import sm_count

    for index in range(torch.cuda.device_count()):
        assert sm_count(index) == torch.cuda.get_device_properties(index).multi_processor_count
        major, minor = torch.cuda.get_device_capability(index)
        assert launch_ctypes.compute_capability(index) == major * 10 + minor


@pytest.mark.gpu
def test_the_real_drivers_error_is_named():
    """A cubin the driver refuses raises CudaError with the call and the driver's own error name."""
    import torch

    torch.zeros(1, device="cuda:0")  # torch's context, as a checksum's caller has
    with pytest.raises(CudaError, match=r"cuModuleLoadData\(bad.cubin on cuda:0\) failed with CUDA_ERROR_[A-Z_]+ \(\d+\)") as err:
        launch_ctypes.load_function(b"this is no cubin\0", "k", 0, "bad.cubin")  # read as PTX text: refused
    assert err.value.code != 0 and err.value.name.startswith("CUDA_ERROR_")
