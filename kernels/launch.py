"""Launch a Triton kernel with its compiled object cached, so a repeated launch costs the launch.

``kernel[grid](...)`` binds and specialises every argument in Python on every call (tens of
microseconds), and the movers' tensor views of raw pointers (CuPy ``UnownedMemory`` + DLPack)
cost as much again. :func:`launch` pays that once per *specialisation* -- device, constexprs,
warps, stages, pointer dtypes, and the facts Triton specialises scalars on (16-byte alignment of
pointers; integers equal to 1, divisible by 16, or past int32) -- and afterwards calls the
compiled kernel's own runner (``CompiledKernel[grid](*args, stream=...)``) with plain ints.

Under ``TRITON_INTERPRET=1`` there is nothing to cache: every launch goes through
``kernel[grid]`` with the tensor views, on host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .views import interpreting, launch_on_index

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True, eq=False)
class LaunchConfig:
    """Everything of a launch that is fixed for a mover: built once (``functools.cache`` in the
    wrappers), so it is hashed by identity on every launch (a field-wise hash costs a microsecond).

    ``constexprs``: ``(name, value)`` pairs of the kernel's ``tl.constexpr`` parameters, which
    must come after its runtime parameters. ``pointers``: for each runtime argument, the name of
    the element type its pointer views (``None`` for a scalar).
    """

    constexprs: tuple[tuple[str, Any], ...]
    pointers: tuple[Any, ...]
    num_warps: int
    num_stages: int

    @property
    def constexpr_values(self) -> tuple[Any, ...]:
        return tuple(v for _, v in self.constexprs)


def _specialisation(args: tuple[int, ...], pointers: tuple[Any, ...]) -> tuple:
    """A superset of what Triton specialises the runtime arguments on (a finer key is only a
    second compile, never a wrong kernel)."""
    return tuple((a % 16 == 0) if p is not None else (a == 1, a % 16 == 0, _I32_MIN <= a <= _I32_MAX)
                 for a, p in zip(args, pointers))


_compiled: dict[tuple, Any] = {}


def launch(kernel, config: LaunchConfig, grid: tuple[int, ...], args: tuple[int, ...], *, device: int,
           stream: int, views: Callable[[], tuple]) -> None:
    """Launch ``kernel`` on ``grid`` with runtime ``args`` (pointers as ints) on CUDA ``device``'s
    ``stream`` (a raw handle). ``views()`` returns the same arguments with pointers as tensors:
    used for the first launch of a specialisation (which compiles) and under the interpreter."""
    if interpreting():
        kernel[grid](*views(), **dict(config.constexprs), num_warps=config.num_warps, num_stages=config.num_stages)
        return
    key = (kernel, config, device, _specialisation(args, config.pointers))
    compiled = _compiled.get(key)
    import torch

    if compiled is None:
        with launch_on_index(device, stream):
            compiled = kernel[grid](*views(), **dict(config.constexprs), num_warps=config.num_warps,
                                    num_stages=config.num_stages)
        _compiled[key] = compiled
        return
    # A compiled kernel's runner reads grid[0..2] (``kernel[grid]`` pads the grid itself, it does not).
    grid3 = (*grid, 1, 1)[:3]
    # the compiled function belongs to ``device``'s context: make it current only when it is not
    if torch.cuda.current_device() != device:
        with torch.cuda.device(device):
            compiled[grid3](*args, *config.constexpr_values, stream=stream)
    else:
        compiled[grid3](*args, *config.constexpr_values, stream=stream)


__all__ = ["LaunchConfig", "launch"]
