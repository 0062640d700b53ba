"""Cached Triton launches (kernels/launch.py): the first launch of a specialisation compiles
through ``kernel[grid]`` with tensor views, later ones call the compiled kernel's runner with
plain ints; anything Triton specialises on (alignment, 1, int32 range) compiles again.

A recording stand-in plays the kernel, so this runs without a GPU; the TMA scratch reuse runs
on a GPU only (it allocates CUDA memory)."""

import contextlib

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
