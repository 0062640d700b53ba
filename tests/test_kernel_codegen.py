"""The GPU kernels compile for Hopper (sm_90) with Triton's bundled ptxas, without a GPU, and move
16-byte vectors where their bandwidth depends on it; the flag kernel reads the global timer and
its flags with acquire loads at system scope.

The interpreter replaces ``triton.jit`` at import, so this compiles in a child process without
``TRITON_INTERPRET``."""

import json
from pathlib import Path

import pytest

from _python import run_compiling

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

SCRIPT = r'''
import json, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashboot.kernels.checksum import checksum_words_kernel
from flashboot.kernels.copy_table import copy_table_kernel, copy_table_tma_kernel
from flashboot.kernels.flag_copy import flag_chain_copy_kernel

D = [["tt.divisibility", 16]]  # what Triton specialises 16-byte aligned pointers and sizes on
def build(fn, sig, consts, aligned, **opts):
    k = triton.compile(ASTSource(fn, sig, consts, attrs={(i,): D for i in aligned}),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = k.asm["ptx"]
    return {"access": sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))), "globaltimer": "%globaltimer" in ptx, "nanosleep": "nanosleep" in ptx,
            "tma": "cp.async.bulk.tensor" in ptx}
table_sig = {"table_ptr": "*i64", "runs_ptr": "*i64", "tile_rows_ptr": "*i64", "n_entries": "i64", "n_tiles": "i64",
             "ELEM": "constexpr", "ELEM_BYTES": "constexpr", "ALIGN16": "constexpr", "BLOCK": "constexpr",
             "STRIDED": "constexpr", "TILE_MAP": "constexpr"}
out = {
    "table": build(copy_table_kernel, table_sig, {"ELEM": tl.int64, "ELEM_BYTES": 8, "ALIGN16": True, "BLOCK": 4096,
                                                    "STRIDED": False, "TILE_MAP": False},
                   [0], num_warps=4, num_stages=3),
    "tma_table": build(copy_table_tma_kernel, {"table_ptr": "*i64", "n_entries": "i64", "n_tiles": "i64",
                       "BLOCK": "constexpr"}, {"BLOCK": 4096}, [0], num_warps=4, num_stages=3),
    "copy_checksum": build(checksum_words_kernel, {"words_ptr": "*i32", "sums_ptr": "*i64", "copy_ptr": "*i32",
                           "n_words": "i64", "chunk_words": "i64", "start_word": "i64", "tiles_per_chunk": "i64",
                           "n_tiles": "i64", "BLOCK": "constexpr", "COPY": "constexpr"}, {"BLOCK": 1024, "COPY": True},
                           range(6), num_warps=4, num_stages=3),
    "flag": build(flag_chain_copy_kernel, {"dst_ptr": "*i64", "src_ptr": "*i64", "ready_ptr": "*i32", "done_ptr": "*i32",
                  "count_ptr": "*i32", "error_ptr": "*i32", "abort_ptr": "*i32", "n_elems": "i64", "chunk_elems": "i64",
                  "tiles_per_chunk": "i64", "n_tiles": "i64", "epoch": "i32", "max_wait": "i64", "BLOCK": "constexpr",
                  "TIMER": "constexpr"}, {"BLOCK": 4096, "TIMER": True}, [0, 1, 2, 3, 4, 7, 8], num_warps=4, num_stages=1),
}
print(json.dumps(out))
'''


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel carries no ptxas to compile with")
def test_gpu_kernels_compile_for_hopper_with_vector_accesses():
    out = json.loads(run_compiling(SCRIPT).strip().splitlines()[-1])
    assert {"ld.global.v2.b64", "st.global.v2.b64"} <= set(out["table"]["access"])
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= set(out["copy_checksum"]["access"])
    assert {"ld.global.cg.v2.b64", "st.global.v2.b64", "ld.global.sys.acquire.b32"} <= set(out["flag"]["access"])
    assert out["flag"]["globaltimer"] and out["flag"]["nanosleep"]
    assert out["tma_table"]["tma"] and not out["table"]["tma"]
