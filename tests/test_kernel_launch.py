"""Cached Triton launches (kernels/launch.py): the first launch of a specialisation compiles
through ``kernel[grid]`` with tensor views, later ones call the compiled kernel's runner with
plain ints; anything Triton specialises on (alignment, 1, int32 range) compiles again.

A recording stand-in plays the kernel, so this runs without a GPU; the TMA scratch reuse runs
on a GPU only (it allocates CUDA memory)."""

import contextlib
import ctypes
import types

import pytest
import torch

from flashboot.kernels import launch as kl


class RecordingKernel:
    """``kernel[grid](...)`` records a compile and returns a compiled kernel whose runner records launches."""

    def __init__(self):
        self.compiles, self.launches = [], []

    def __getitem__(self, grid):
        def compile_and_launch(*args, **kwargs):
            self.compiles.append((grid, args, kwargs))
            return Compiled(self, len(self.compiles))

        return compile_and_launch


class Compiled:
    def __init__(self, kernel, n):
        self.kernel, self.n = kernel, n

    def __getitem__(self, grid):
        def runner(*args, stream):
            self.kernel.launches.append((self.n, grid, args, stream))

        return runner


@pytest.fixture
def gpu_less(monkeypatch):
    monkeypatch.setattr(kl, "interpreting", lambda: False)
    monkeypatch.setattr(kl, "launch_on_index", lambda device, stream: contextlib.nullcontext())
    monkeypatch.setattr(kl, "_get_device", lambda: 0)
    monkeypatch.setattr(kl, "_compiled", {})
    monkeypatch.setattr(kl, "_runners", {})


def test_cached_launch_compiles_once_per_specialisation(gpu_less):
    k = RecordingKernel()
    config = kl.LaunchConfig((("BLOCK", 64),), ("int64", "int64", None), num_warps=4, num_stages=3)
    views = lambda: ("dst-view", "src-view", 4096)  # noqa: E731
    kl.launch(k, config, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=views)
    assert k.compiles == [((8,), ("dst-view", "src-view", 4096), {"BLOCK": 64, "num_warps": 4, "num_stages": 3})]
    assert k.launches == []  # the compiling call launched
    # same specialisation (other pointers, other size, other grid): the runner, with ints and a 3-D grid
    kl.launch(k, config, (8,), (0x3000, 0x5000, 8192), device=0, stream=7, views=views)
    kl.launch(k, config, (2,), (0x3000, 0x5000, 8192), device=0, stream=9, views=views)
    assert k.launches == [(1, (8, 1, 1), (0x3000, 0x5000, 8192, 64), 7), (1, (2, 1, 1), (0x3000, 0x5000, 8192, 64), 9)]
    assert len(k.compiles) == 1
    # what Triton specialises on compiles again: a pointer off 16 bytes, a size of 1, a size past int32
    for args in ((0x3008, 0x5000, 8192), (0x3000, 0x5000, 1), (0x3000, 0x5000, 1 << 33)):
        kl.launch(k, config, (8,), args, device=0, stream=7, views=views)
    assert len(k.compiles) == 4 and len(k.launches) == 2
    # another device is another compiled kernel (its own context)
    kl.launch(k, config, (8,), (0x3000, 0x5000, 8192), device=1, stream=7, views=views)
    assert len(k.compiles) == 5


@pytest.mark.gpu
def test_tma_scratch_is_reused_per_stream():
    from flashboot.kernels.copy import _tma_allocator

    s1, s2 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0)
    with torch.cuda.device(0):
        a = _tma_allocator(4096, 128, s1.cuda_stream)
        assert _tma_allocator(2048, 128, s1.cuda_stream).data_ptr() == a.data_ptr()  # fits: the same buffer
        b = _tma_allocator(4096, 128, s2.cuda_stream)
        assert b.data_ptr() != a.data_ptr()  # another stream may run at the same time: its own
        c = _tma_allocator(1 << 20, 128, s1.cuda_stream)
        assert c.numel() >= 1 << 20 and c.data_ptr() % 128 == 0


@pytest.mark.parametrize("kind", ["sm", "tma"])
def test_mover_launchers_call_the_kept_runner_for_aligned_copies(gpu_less, monkeypatch, kind):
    """The movers' hot path: a 16-byte aligned copy calls the runner the launcher kept for its
    grid with plain ints, without building a launch key; other copies go through ``launch``."""
    from flashboot.kernels import copy as kc
    from flashboot.memory import Span, cuda_device

    k = RecordingKernel()
    monkeypatch.setattr(kc, "copy_sm_kernel" if kind == "sm" else "copy_tma_kernel", k)
    monkeypatch.setattr(kc, "sm_count", lambda index: 4)
    monkeypatch.setattr(kc, "current_device", lambda: 0)
    monkeypatch.setattr(kc, "_ensure_tma_allocator", lambda: None)
    monkeypatch.setattr(kc, "span_tensor", lambda span, itemsize, offset, nbytes: ("view", span.ptr + offset, nbytes))
    launcher = kc.SMCopyLauncher(kc.SM_TUNING) if kind == "sm" else kc.TMACopyLauncher(kc.TMA_TUNING)
    consts = (4096, "", "") if kind == "sm" else (4096,)  # BLOCK (32 KiB of int64) and the cache modifiers
    dev = cuda_device(0)
    dst, src = Span(0x100000, 1 << 20, dev), Span(0x300000, 1 << 20, dev)
    launcher(dst, src, 4096, 7)  # compiles
    launcher(dst, src, 4096, 7)  # launch's cached runner, which the launcher keeps
    assert len(k.compiles) == 1 and k.launches == [(1, (1, 1, 1), (0x100000, 0x300000, 512, *consts), 7)]
    kl._runners.clear()
    kl._compiled.clear()  # launch's caches are gone: only the kept runner can launch without compiling
    launcher(dst.sub(65536), src.sub(131072), 8192, 9)
    assert len(k.compiles) == 1
    assert k.launches[-1] == (1, (1, 1, 1), (0x100000 + 65536, 0x300000 + 131072, 1024, *consts), 9)
    # another grid (3 tiles of 4096 int64): through launch, which compiles again (its caches were cleared)
    launcher(dst, src, 3 * 32768, 7)
    assert len(k.compiles) == 2 and k.compiles[-1][0] == (3,)
    # a pointer off 16 bytes is not the hot path: launch's split (the SM kernel then moves 8-byte words)
    if kind == "sm":
        launcher(dst.sub(8), src, 4096, 7)
        assert len(k.compiles) == 3 and k.compiles[-1][1][2] == 512 and k.compiles[-1][2]["BLOCK"] == 4096


class LauncherCompiled(Compiled):
    """A compiled kernel with Triton's launcher attributes: ``run(gridX, ..., *args)``."""

    function, packed_metadata = "cu-function", ("packed",)

    def __init__(self, kernel, n, signature):
        super().__init__(kernel, n)
        self.direct = []
        if signature == "named":  # Triton 3.7 and later
            def run(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                    launch_exit_hook, *args):
                self.direct.append(((gridX, gridY, gridZ), stream, function, kernel_metadata, launch_metadata,
                                    launch_enter_hook, launch_exit_hook, args))
        elif signature == "positional":  # before: the same arguments, in *args
            def run(gridX, gridY, gridZ, stream, function, *args):
                self.direct.append(((gridX, gridY, gridZ), stream, function, *args[:4], args[4:]))
        elif signature == "refusing":  # the known signature, but the launcher rejects the arguments
            def run(gridX, gridY, gridZ, stream, function, *args):
                self.direct.append("refused")
                raise TypeError("launch() takes 14 positional arguments")
        else:
            def run(grid, stream, *args):
                raise AssertionError("a launcher of unknown signature must not be called directly")
        self.run = run


@pytest.mark.parametrize("signature", ["named", "positional", "unknown"])
def test_cached_launch_calls_tritons_launcher_directly_unless_hooks_are_installed(gpu_less, monkeypatch, signature):
    from triton import knobs

    k = RecordingKernel()
    compiled = LauncherCompiled(k, 1, signature)
    signature_ok = signature != "unknown"
    config = kl.LaunchConfig((("BLOCK", 64),), ("int64", "int64", None), num_warps=4, num_stages=3)
    key = (id(k), config, 0, kl._specialisation((0x1000, 0x2000, 4096), config.is_pointer))
    kl._compiled[key] = compiled  # as after the compiling launch
    kl.launch(k, config, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=None)
    if signature_ok:  # no hook metadata, no hooks: the launcher with the grid, stream and ints
        assert compiled.direct == [((8, 1, 1), 7, "cu-function", ("packed",), None, None, None, (0x1000, 0x2000, 4096, 64))]
        assert k.launches == []
    else:  # another Triton's launcher: the compiled kernel's own runner
        assert k.launches == [(1, (8, 1, 1), (0x1000, 0x2000, 4096, 64), 7)]
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: seen.append(metadata))
    kl.launch(k, config, (8,), (0x1000, 0x2000, 4096), device=0, stream=9, views=None)
    assert k.launches[-1] == (1, (8, 1, 1), (0x1000, 0x2000, 4096, 64), 9)  # a profiler's hook: the runner, hooks and all
    assert len(compiled.direct) == (1 if signature_ok else 0)


def test_a_launcher_that_refuses_the_direct_call_is_warned_about_and_the_runner_launches(gpu_less):
    k = RecordingKernel()
    compiled = LauncherCompiled(k, 1, "refusing")
    config = kl.LaunchConfig((("BLOCK", 64),), ("int64", "int64", None), num_warps=4, num_stages=3)
    kl._compiled[(id(k), config, 0, kl._specialisation((0x1000, 0x2000, 4096), config.is_pointer))] = compiled
    with pytest.warns(RuntimeWarning, match=r"refused the direct call \(launch\(\) takes 14 positional arguments\)"):
        kl.launch(k, config, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=None)
    kl.launch(k, config, (8,), (0x1000, 0x2000, 4096), device=0, stream=9, views=None)
    assert compiled.direct == ["refused"]  # tried once, then the runner only
    assert [launch[3] for launch in k.launches] == [7, 9]


class DriverCompiled(Compiled):
    """A compiled kernel as Triton leaves it once loaded: its ``CUfunction`` (an int), metadata and
    source signature (the SM copy kernel's: two pointers, an int64, a constexpr)."""

    function = 0xF00D

    def __init__(self, kernel, n, **metadata):
        super().__init__(kernel, n)
        md = {"num_warps": 8, "shared": 1024, "num_ctas": 1, "launch_cooperative_grid": False, "launch_pdl": False,
              "global_scratch_size": 0, "global_scratch_align": 1, "profile_scratch_size": 0,
              "profile_scratch_align": 1, "name": "copy_sm_kernel", **metadata}
        self.metadata = types.SimpleNamespace(**md)
        self.src = types.SimpleNamespace(signature={"dst_ptr": "*i64", "src_ptr": "*i64", "n_elems": "i64",
                                                    "BLOCK": "constexpr"}, constants={})


class FakeDriver:
    """``cuLaunchKernel`` as ctypes calls it (ints), reading each parameter back through its pointer."""

    def __init__(self, result: int = 0):
        self.launches, self.result = [], result

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        ptrs = (ctypes.c_void_p * 5).from_address(params)
        values = [ctypes.c_uint64.from_address(ptrs[i]).value if ptrs[i] else None for i in range(3)]
        scratch = [ctypes.c_uint64.from_address(ptrs[i]).value for i in (3, 4)]
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, values, scratch, extra))
        return self.result

    def cuGetErrorName(self, code, out):
        return 1  # an unknown code: no name

    cuGetErrorString = cuGetErrorName


@pytest.fixture
def fake_driver(monkeypatch):
    from flashboot.kernels import launch_ctypes

    drv = FakeDriver()
    monkeypatch.setattr(launch_ctypes, "_driver", lambda: drv)
    monkeypatch.delenv(kl.DRIVER_LAUNCH_ENV, raising=False)
    return drv


def _compiled_for(k, config, args, **metadata):
    compiled = DriverCompiled(k, 1, **metadata)
    kl._compiled[(id(k), config, 0, kl._specialisation(args, config.is_pointer))] = compiled  # as after its first launch
    return compiled


CONFIG = kl.LaunchConfig((("BLOCK", 64),), ("int64", "int64", None), num_warps=8, num_stages=3)


def test_a_cached_launch_goes_to_the_driver_with_the_arguments_as_tritons_launcher_lays_them(gpu_less, fake_driver):
    k = RecordingKernel()
    _compiled_for(k, CONFIG, (0x1000, 0x2000, 4096))
    kl.launch(k, CONFIG, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=None)
    kl.launch(k, CONFIG, (8,), (0x3000, 0x5000, 1 << 20), device=0, stream=9, views=None)
    # the function, the grid, 32 threads a warp, the metadata's shared memory, the stream; then
    # the runtime arguments (the constexpr is not passed) and two null scratch pointers
    assert fake_driver.launches == [
        (0xF00D, (8, 1, 1), (256, 1, 1), 1024, 7, [0x1000, 0x2000, 4096], [0, 0], None),
        (0xF00D, (8, 1, 1), (256, 1, 1), 1024, 9, [0x3000, 0x5000, 1 << 20], [0, 0], None)]
    assert k.launches == [] and k.compiles == []


def test_global_scratch_is_asked_once_per_stream_and_passed_after_the_arguments(gpu_less, fake_driver, monkeypatch):
    from triton.runtime import _allocation

    asked = []

    class Buffer:
        def __init__(self, n):
            self.address = 0x7000000 + 0x100000 * n

        def data_ptr(self):
            return self.address

    def allocate(size, align, stream):
        asked.append((size, align, stream))
        return Buffer(len(asked))

    monkeypatch.setattr(_allocation, "_allocator", types.SimpleNamespace(get=lambda: allocate))
    k = RecordingKernel()
    _compiled_for(k, CONFIG, (0x1000, 0x2000, 4096), global_scratch_size=128, global_scratch_align=64,
                  name="copy_tma_kernel")
    for stream in (7, 7, 9, 7):
        kl.launch(k, CONFIG, (4,), (0x1000, 0x2000, 4096), device=0, stream=stream, views=None)
    assert asked == [(4 * 128, 64, 7), (4 * 128, 64, 9)]  # grid x scratch per program, once per stream
    assert [l[6] for l in fake_driver.launches] == [[0x7100000, 0], [0x7100000, 0], [0x7200000, 0], [0x7100000, 0]]


@pytest.mark.parametrize("why", ["clusters", "profile scratch", "oversized shared memory", "a float argument",
                                 "the environment", "a profiler's hooks"])
def test_a_kernel_the_driver_runner_does_not_reproduce_launches_through_triton(gpu_less, fake_driver, monkeypatch, why):
    from triton import knobs

    k = RecordingKernel()
    metadata = {"clusters": {"num_ctas": 2}, "profile scratch": {"profile_scratch_size": 64},
                "oversized shared memory": {"shared": 229 << 10}}.get(why, {})
    compiled = _compiled_for(k, CONFIG, (0x1000, 0x2000, 4096), **metadata)
    if why == "a float argument":
        compiled.src.signature["n_elems"] = "fp16"
    if why == "the environment":
        monkeypatch.setenv(kl.DRIVER_LAUNCH_ENV, "triton")
    if why == "a profiler's hooks":
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    kl.launch(k, CONFIG, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=None)
    assert fake_driver.launches == [] and k.launches == [(1, (8, 1, 1), (0x1000, 0x2000, 4096, 64), 7)]


def test_a_driver_error_names_the_launch(gpu_less, fake_driver):
    from flashboot.errors import CudaError

    fake_driver.result = 701  # CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    k = RecordingKernel()
    _compiled_for(k, CONFIG, (0x1000, 0x2000, 4096))
    with pytest.raises(CudaError, match=r"cuLaunchKernel\(copy_sm_kernel, grid 8x1x1\)"):
        kl.launch(k, CONFIG, (8,), (0x1000, 0x2000, 4096), device=0, stream=7, views=None)
