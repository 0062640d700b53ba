"""The binary tensor table (tensors.bin): the same table as metadata.json, bound to its bytes;
anything else is refused before a byte is copied."""

import hashlib
import json
import random
import shutil

import pytest
import torch
from flashboot.layouts import read_image
from flashboot.layouts.format import TensorTable, parse_metadata
from flashboot.layouts.image import open_image, read_metadata_file, verify_image
from flashboot.layouts.table import TABLE_FILE, decode_table, encode_table, tables_agree
from flashboot.layouts.tiny import save_tiny_model

import flashboot
from flashboot.errors import FlashBootError, LayoutError


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("table")
    save_tiny_model("qwen3_moe", root / "hf", dtype=torch.bfloat16)
    flashboot.prepack(str(root / "hf"), str(root / "tp1"), chunk_bytes=16384, progress=False)
    flashboot.prepack(str(root / "hf"), str(root / "tp2"), tp=2, chunk_bytes=16384, progress=False)
    return root


@pytest.fixture
def image(packed, tmp_path):
    return shutil.copytree(packed / "tp2", tmp_path / "tp2")


@pytest.mark.parametrize("job,rank", [("tp1", 0), ("tp2", 0), ("tp2", 1)])
def test_binary_table_is_the_json_table(packed, job, rank):
    img = read_image(packed / job, rank)
    assert img.table_source == TABLE_FILE
    from_json = parse_metadata(img.metadata_path.read_bytes(), "json").tensors
    assert tables_agree(img.metadata.tensors, from_json) is None
    if job == "tp2":  # sharded tensors carry their splits through the columns
        assert any(img.metadata.tensors.shard_of(i) for i in range(len(from_json)))
    assert [e.shape for e in img.metadata.tensors.entries()] == [e.shape for e in from_json.entries()]
    assert verify_image(packed / job, rank)[0].chunks > 0  # compares the two tables too


def test_views_from_the_columns_are_the_arenas_own_views(packed):
    """The binary table keeps shapes and strides as columns and the views are made from them in
    bulk (runs of one shape at a constant spacing through one unbind each); they must be exactly
    what ``arena.view`` gives for each tensor, and the JSON table must give the same."""
    from flashboot.arena import Arena
    from flashboot.flashload import views as views_module
    from flashboot.flashload.views import make_views

    img = read_image(packed / "tp1", 0)
    from_json = parse_metadata(img.metadata_path.read_bytes(), "json")
    assert len(set(from_json.tensors.dim_columns().ndims.tolist())) > 1  # 1-D norms beside 2-D and 3-D weights
    runs = []
    real_runs = views_module._run_views

    def spy(typed, size, stride, start):
        runs.append(size[0])
        return real_runs(typed, size, stride, start)

    views_module._run_views = spy
    try:
        with Arena.create(img.nbytes, "cpu") as arena:
            arena.bytes()[:img.nbytes] = torch.frombuffer(bytearray(img.path.read_bytes()), dtype=torch.uint8)
            columns, tuples = make_views(arena, img.metadata), make_views(arena, from_json)
            assert list(columns) == list(tuples) == list(from_json.tensors)
            for name, e in from_json.tensors.items():
                want = arena.view(e.offset, e.shape, e.dtype, e.stride)
                for got in (columns[name], tuples[name]):
                    assert (got.dtype, got.shape, got.stride(), got.data_ptr()) == \
                        (want.dtype, want.shape, want.stride(), want.data_ptr())
                    assert torch.equal(got.reshape(-1).view(torch.uint8), img.view(name).reshape(-1).view(torch.uint8))
            del columns, tuples, want, got
    finally:
        views_module._run_views = real_runs
    assert runs and min(runs) >= 2  # some views (the experts' projections) were made as runs, not one by one
    # the tuples, built on demand from the columns, are the JSON table's
    assert img.metadata.tensors.shapes == from_json.tensors.shapes
    assert img.metadata.tensors.strides == from_json.tensors.strides


def test_edited_metadata_with_its_table_is_refused_naming_both_digests(image):
    meta_path = image / "rank-0" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["tensors"][next(iter(meta["tensors"]))]  # a tensor removed from the JSON table
    raw = json.dumps(meta).encode()
    meta_path.write_bytes(raw)
    job_path = image / "prepack.json"  # the job's digest re-recorded too: only the table's binding is left
    job = json.loads(job_path.read_text())
    next(e for e in job["ranks"] if e["dir"] == "rank-0")["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    job_path.write_text(json.dumps(job))
    with pytest.raises(LayoutError, match=r"tensors.bin: written for a metadata.json of sha256 [0-9a-f]{16}, the one "
                                          r"beside it has [0-9a-f]{16}"):
        read_image(image, 0)


def test_a_self_consistent_but_different_table_is_caught_by_verify(image):
    """The columns are bound to the JSON's bytes, not to its meaning: a table re-encoded from other
    entries reads, and `verify` (which compares entry by entry) refuses it."""
    mf = read_metadata_file(image, 0)
    t = read_image(image, 0).metadata.tensors
    swapped = TensorTable(t.names[::-1], t.offsets[::-1], t.nbytes[::-1], t.dtype_codes[::-1], t.region_codes[::-1],
                          t.shapes[::-1], t.strides[::-1], [t.shard_of(i) or None for i in range(len(t))][::-1])
    (image / "rank-0" / TABLE_FILE).write_bytes(encode_table(swapped, mf.raw))
    with pytest.raises(LayoutError, match="disagrees with .*metadata.json: names differ at entry 0"):
        verify_image(image, 0)


def _damaged(good: bytes, rng: random.Random) -> bytes:
    """``good`` with 1-3 random bytes changed and, one time in five, cut short."""
    data = bytearray(good)
    for _ in range(rng.randint(1, 3)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    if rng.random() < 0.2:
        data = data[:rng.randrange(len(data))]
    return bytes(data)


def test_damaged_table_bytes_are_refused(image):
    path = image / "rank-0" / TABLE_FILE
    good = path.read_bytes()
    raw = (image / "rank-0" / "metadata.json").read_bytes()
    rng = random.Random(7)
    outcomes = {"refused": 0, "same": 0}
    for _ in range(400):
        try:
            table, _ = decode_table(_damaged(good, rng), raw, "fuzz")
        except FlashBootError:
            outcomes["refused"] += 1
            continue
        # accepted only when the flipped bytes were the header's padding or a no-op flip
        assert tables_agree(table, decode_table(good, raw, "good")[0]) is None
        outcomes["same"] += 1
    assert outcomes["refused"] > 350


def test_the_table_decoded_while_the_metadata_is_read_reads_and_refuses_as_after_it(image):
    """read_metadata_file(decode=True) decodes tensors.bin while metadata.json is read and hashed
    in a thread: every damaged table (and an edited metadata.json) ends the same as decoding after
    the read, the same error first, and a good one reads the same table. So does the early call's
    read without threads (``begin_metadata_read(beside=False)``: read, hashed and decoded in turn)."""
    from flashboot.layouts.image import begin_metadata_read

    table_path, meta_path = image / "rank-0" / TABLE_FILE, image / "rank-0" / "metadata.json"
    good, raw = table_path.read_bytes(), meta_path.read_bytes()
    reference = read_image(image, 0).metadata.tensors

    def outcome(decode):
        try:
            if decode == "inline":
                mf = begin_metadata_read(image, 0, beside=False).finish()
            else:
                mf = read_metadata_file(image, 0, decode=decode)
            assert (mf.decoded is not None) == bool(decode)
            return "read", tables_agree(open_image(mf, 0).metadata.tensors, reference)
        except FlashBootError as exc:
            return "refused", str(exc)

    assert outcome(True) == outcome(False) == outcome("inline") == ("read", None)
    rng = random.Random(11)
    refused = 0
    for _ in range(120):
        table_path.write_bytes(_damaged(good, rng))
        early = outcome(True)
        assert early == outcome(False) == outcome("inline")
        refused += early[0] == "refused"
    assert refused > 100
    table_path.write_bytes(good)
    meta_path.write_bytes(raw.replace(b'"format_version": 1', b'"format_version":  1'))  # same JSON, other bytes
    early = outcome(True)
    assert early == outcome(False) == outcome("inline") and early[0] == "refused"
    assert "the metadata was edited or damaged" in early[1]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_damaged_column_is_named_a_damaged_file_hashed_inline_or_beside(image, monkeypatch, threaded):
    from flashboot.layouts import table as table_mod

    monkeypatch.setattr(table_mod, "THREAD_HASH_NBYTES", 0 if threaded else 1 << 40)
    good = (image / "rank-0" / TABLE_FILE).read_bytes()
    raw = (image / "rank-0" / "metadata.json").read_bytes()
    reference, _ = decode_table(good, raw, "good")
    assert tables_agree(decode_table(good, raw, "again")[0], reference) is None
    n = len(reference)
    names_nbytes = len("\0".join(reference.names).encode())
    dtype_at = len(good) - names_nbytes - 3 * n  # the first tensor's dtype code
    data = bytearray(good)
    data[dtype_at] = 250  # an invalid dtype, which the column checks would name: the hash is named first
    with pytest.raises(LayoutError, match=r"fuzz: columns of sha256 \w+, the header records \w+ \(damaged file\)"):
        decode_table(bytes(data), raw, "fuzz")


def test_json_only_image_reads_the_same(image):
    with_table = read_image(image, 0).metadata
    (image / "rank-0" / TABLE_FILE).unlink()
    img = read_image(image, 0)
    assert img.table_source == "metadata.json"
    assert tables_agree(img.metadata.tensors, with_table.tensors) is None
    assert img.metadata.key == with_table.key and img.metadata.checksums == with_table.checksums


def test_tables_with_fused_parts_stay_json_only(packed):
    t = read_image(packed / "tp1", 0).metadata.tensors
    from flashboot.layouts.format import Part

    fused = TensorTable(t.names, t.offsets, t.nbytes, t.dtype_codes, t.region_codes, t.shapes, t.strides,
                        parts={0: (Part("a", 0, 1),)})
    assert encode_table(fused, b'{\n "tensors": {}\n}\n') is None


@pytest.mark.parametrize("seed", range(5))
def test_view_runs_cover_every_tensor_once_each_run_arithmetic(seed):
    import numpy as np
    from flashboot.layouts.view_order import _runs

    rng = np.random.default_rng(seed)
    # experts-like: alternating gaps (w1 / w3 of one shape), layers apart, plus stray tensors
    offs = np.cumsum(rng.choice([256, 512, 768, 4096], size=rng.integers(2, 400), p=[0.4, 0.4, 0.1, 0.1]))
    runs, rest = _runs(offs)
    members = np.concatenate(runs + [rest])
    assert sorted(members.tolist()) == list(range(len(offs)))  # every tensor exactly once
    for m in runs:
        start, step = offs[m[0]], offs[m[1]] - offs[m[0]]
        assert len(m) >= 2 and step > 0 and offs[m].tolist() == [start + step * i for i in range(len(m))]


def test_spans_of_padded_columns_equal_the_flattened_ones():
    import numpy as np

    from flashboot.layouts.table import _padded_spans
    from flashboot.layouts.tensor_table import _ITEMSIZE, _spans

    rng = np.random.default_rng(5)
    n, d = 2000, 5
    ndims = rng.integers(0, d + 1, n)
    live = np.arange(d)[None, :] < ndims[:, None]
    shapes = np.where(live, rng.integers(0, 9, (n, d)), 0)  # zeros in ~1/9 of the live dims: empty tensors
    strides = np.where(live, rng.integers(0, 50, (n, d)), 0)
    itemsize = _ITEMSIZE[rng.integers(0, len(_ITEMSIZE), n)]
    want_nbytes, want_estimate = _spans(ndims, shapes[live], strides[live], itemsize)
    nbytes, estimate = _padded_spans(shapes, strides, ndims, itemsize)
    assert (want_nbytes == 0).sum() > 100 and (ndims == 0).sum() > 100
    assert np.array_equal(nbytes, want_nbytes) and np.array_equal(estimate, want_estimate)


def test_a_hash_past_its_timeout_is_named(image, monkeypatch):
    import time

    from flashboot.layouts import table as table_mod

    class SlowHash:
        @staticmethod
        def sha256(data):
            time.sleep(0.5)
            return hashlib.sha256(data)

    good = (image / "rank-0" / TABLE_FILE).read_bytes()
    raw = (image / "rank-0" / "metadata.json").read_bytes()
    monkeypatch.setattr(table_mod, "THREAD_HASH_NBYTES", 0)
    monkeypatch.setattr(table_mod, "HASH_TIMEOUT_S", 0.05)
    monkeypatch.setattr(table_mod, "hashlib", SlowHash)
    with pytest.raises(LayoutError, match=r"hashing [\d,]+ bytes took over 0.05 s"):
        decode_table(good, raw, "slow", hashlib.sha256(raw).hexdigest())
    time.sleep(0.6)  # the hash thread ends before the patch is undone


@pytest.mark.parametrize("names, refusal", [
    (["a", "", "c"], r"the name blob holds 3 names \(or an empty one\) for 3 tensors"),
    (["", "b", "c"], r"the name blob holds 3 names \(or an empty one\) for 3 tensors"),
    (["a", "b", ""], r"the name blob holds 3 names \(or an empty one\) for 3 tensors"),
    (["a", "b", "a"], r"tensor 'a' appears twice"),
])
def test_an_empty_or_repeated_name_is_refused(names, refusal):
    import numpy as np

    n = len(names)
    table = TensorTable(names, np.arange(n) * 64, np.full(n, 16), np.zeros(n, np.uint8), np.zeros(n, np.uint8),
                        [(2,)] * n, [(1,)] * n)
    meta_bytes = b'{\n "tensors": {}}'
    with pytest.raises(LayoutError, match=refusal):
        decode_table(encode_table(table, meta_bytes), meta_bytes, "tensors.bin")
    fine = TensorTable(["a", "b", "c"], table.offsets, table.nbytes, table.dtype_codes, table.region_codes,
                       [(2,)] * n, [(1,)] * n)  # the same table with three names is read back
    assert tables_agree(decode_table(encode_table(fine, meta_bytes), meta_bytes, "tensors.bin")[0], fine) is None
