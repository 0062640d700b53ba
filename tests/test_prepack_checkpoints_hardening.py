"""Pre-pack fed checkpoints as users have them: hub cache snapshots, odd shard indexes, headers
safetensors itself refuses, shards that change while they are read. Each either gives an image
holding exactly what safetensors reads, or is refused naming the file, the tensor and the numbers,
with no image left that looks complete."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import flashboot
from flashboot.errors import LayoutError
from flashboot.flashload.prepack import prepack


def _raw_shard(path: Path, header: dict, data: bytes, *, text: bytes | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = text if text is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    (path.parent / "config.json").write_text('{"model_type": "x"}')
    return path


def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def _loads_as_safetensors_reads(ckpt: Path, out: Path) -> None:
    """Every tensor safetensors reads from ``ckpt`` is in the image with its dtype, shape and bytes."""
    want = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            want.update({k: f.get_tensor(k) for k in f.keys()})
    with flashboot.load(out, 0, "cpu", stream=True, verify=True) as loaded:
        assert set(loaded.tensors) == set(want)
        for name, t in want.items():
            got = loaded.tensors[name]
            assert (got.dtype, got.shape) == (t.dtype, t.shape), name
            assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("header,data,message", [
    # bytes 8..16 of the data belong to no tensor
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2],
      "data_offsets": [16, 24]}}, _f32(1, 2, 3, 4, 5, 6), r"file bytes {base8}..{base16} \(before tensor 'b'\) belong to no tensor"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, _f32(1, 2, 3, 4),
     r"file bytes {base}..{base8} \(before tensor 'a'\) belong to no tensor"),
    # 4 bytes after the last tensor: a shard still being appended to, a rewrite that left a tail
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, _f32(1, 2, 3),
     r"the tensors' data ends at byte {base8:,} but the file has {base12:,} bytes: 4 trailing bytes"),
    ({"__metadata__": {"format": 5}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, _f32(1),
     "__metadata__ must map names to strings"),
], ids=["gap", "gap-at-start", "tail", "metadata-not-strings"])
def test_a_shard_safetensors_refuses_is_refused_before_writing(tmp_path, header, data, message):
    """Each had pre-packed: the image held bytes no safetensors reader gives (gaps, a tail) or
    the file had been taken although no engine can load it."""
    shard = _raw_shard(tmp_path / "ck" / "model.safetensors", header, data)
    base = 8 + len(json.dumps(header))
    with pytest.raises(Exception):
        safe_open(str(shard), "pt")  # safetensors' own verdict
    with pytest.raises(LayoutError, match=f"{shard}: " + message.format(base=base, base8=base + 8, base12=base + 12,
                                                                         base16=base + 16)):
        prepack(shard.parent, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_name_given_twice_in_one_header_is_refused(tmp_path):
    """JSON keeps the last of two entries of one name: the first tensor's bytes had been dropped
    without a word (here the two name 'a' at different offsets, as a buggy writer leaves them)."""
    text = (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
            b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}')
    shard = _raw_shard(tmp_path / "ck" / "model.safetensors", {}, _f32(1, 2, 3, 4), text=text)
    with pytest.raises(LayoutError, match=f"{shard}: the header names 'a' twice"):
        prepack(shard.parent, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_what_safetensors_accepts_is_packed_byte_for_byte(tmp_path):
    """The other side of the rule: zero-size tensors sharing an offset, an unpadded header and
    one of leading blanks are all valid safetensors and pack exactly."""
    header = {"e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [0, 0]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "z": {"dtype": "I8", "shape": [0], "data_offsets": [8, 8]},
              "b": {"dtype": "F16", "shape": [3], "data_offsets": [8, 14]}}
    text = b"  " + json.dumps(header).encode() + b" "
    shard = _raw_shard(tmp_path / "ck" / "model.safetensors", {}, _f32(1.5, -2) + bytes(range(6)), text=text)
    prepack(shard.parent, tmp_path / "out", progress=False)
    _loads_as_safetensors_reads(shard.parent, tmp_path / "out")


def _two_tensor_shard(ckpt: Path) -> Path:
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "x"}')
    save_file({"a": torch.arange(8.0), "b": torch.arange(100.0, 108.0)}, ckpt / "model.safetensors",
              metadata={"format": "pt"})
    return ckpt / "model.safetensors"


def test_a_shard_replaced_after_its_header_was_read_is_refused(tmp_path, monkeypatch):
    """A re-save over the checkpoint while pre-pack planned (a longer header shifts the data): the
    old header's offsets had been applied to the new file, and tensor 'a' packed with 16 bytes of
    the new header's JSON in it, the job committed as complete."""
    import flashboot.layouts.checkpoint as checkpoint

    shard = _two_tensor_shard(tmp_path / "ck")
    real = checkpoint.open_checkpoint

    def resaved_after_planning(path):
        ckpt = real(path)
        save_file({"a": torch.arange(300.0, 308.0), "b": torch.arange(200.0, 208.0)}, shard,
                  metadata={"format": "pt", "note": "saved again"})
        return ckpt

    monkeypatch.setattr(checkpoint, "open_checkpoint", resaved_after_planning)
    with pytest.raises(LayoutError, match=f"{shard}: was replaced by another file since its header was read"):
        prepack(shard.parent, tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]  # no job, no temp directory


def test_a_shard_rewritten_in_place_while_read_is_refused(tmp_path, monkeypatch):
    """The bytes read before and after an in-place rewrite are of two checkpoints."""
    import os

    import flashboot.layouts.checkpoint as checkpoint

    shard = _two_tensor_shard(tmp_path / "ck")
    size = shard.stat().st_size
    real = checkpoint.ShardReader.read

    def read_then_rewritten(self, batch):
        data = real(self, batch)
        with open(shard, "r+b") as f:  # same size, other values: only the file's mtime tells
            f.seek(size - 4)
            f.write(b"\xff" * 4)
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse-clock filesystems too
        return data

    monkeypatch.setattr(checkpoint.ShardReader, "read", read_then_rewritten)
    with pytest.raises(LayoutError, match=rf"{shard}: was modified \({size:,} bytes -> {size:,}, mtime .*while it "
                                          "was read; the bytes read no longer match its header"):
        prepack(shard.parent, tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]


def test_a_hub_snapshot_of_links_into_blobs_packs_and_names_its_repo(tmp_path):
    """models--org--name/snapshots/REV/ holds links into ../../blobs/SHA: read through the links, and
    the key names the repo and the revision; a link whose blob is gone is named."""
    import hashlib
    import os

    repo = tmp_path / "hub" / "models--org--name"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap, blobs = repo / "snapshots" / rev, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    scratch = tmp_path / "scratch.safetensors"

    def blob(data: bytes, name: str) -> None:
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snap / name)

    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(4, 8, generator=g), "b": torch.randn(3, generator=g).half()}, scratch)
    blob(scratch.read_bytes(), "model-00001-of-00002.safetensors")
    save_file({"c.weight": torch.randn(5, 5, generator=g).bfloat16(), "s": torch.tensor(7, dtype=torch.int8)}, scratch)
    blob(scratch.read_bytes(), "model-00002-of-00002.safetensors")
    blob(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                                    "c.weight": "model-00002-of-00002.safetensors",
                                    "s": "model-00002-of-00002.safetensors"}}).encode(), "model.safetensors.index.json")
    blob(b'{"model_type": "x"}', "config.json")
    report = prepack(snap, tmp_path / "out", progress=False)
    _loads_as_safetensors_reads(snap, tmp_path / "out")
    key = flashboot.layouts.read_job(tmp_path / "out").key
    assert (key.model_id, key.revision) == ("org/name", rev) and report.read_nbytes == 4 * 32 + 2 * 3 + 2 * 25 + 1
    second = snap / "model-00002-of-00002.safetensors"
    (snap / os.readlink(second)).unlink()  # the blob is gone, the link stays
    with pytest.raises(LayoutError, match=f"{second}: a link to ../../blobs/[0-9a-f]{{64}}, which does not exist"):
        prepack(snap, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()


def test_names_of_any_unicode_pack_under_a_family(tmp_path):
    """Names are text: a superscript after a digit ("1²") had raised a bare ValueError from the
    natural sort of every family's plan; other digits, dots, slashes, very long names pack as is."""
    from flashboot.layouts.format import natural_key

    names = ["model.norm.1²", "w.٣", "w.3", "w.03", "模型.权重", "a..b", "a/b/c", "../up", "x" * 5000, "emoji😀",
             "q\"uote", "model.layers.10.w", "model.layers.2.w"]
    g = torch.Generator().manual_seed(1)
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    save_file({n: torch.randn(3, generator=g) for n in names}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text('{"model_type": "llama"}')  # a family's plan sorts the names
    prepack(ckpt, tmp_path / "out", progress=False)
    _loads_as_safetensors_reads(ckpt, tmp_path / "out")
    assert sorted(["b.10", "b.2", "b.1²", "b²"], key=natural_key) == ["b.1²", "b.2", "b.10", "b²"]


def _sharded(ckpt: Path, weight_map: dict | None = None) -> dict[str, str]:
    g = torch.Generator().manual_seed(2)
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "x"}')
    save_file({"a": torch.randn(4, 8, generator=g), "b": torch.randn(3, generator=g).half()}, ckpt / "s1.safetensors")
    save_file({"c": torch.randn(5, generator=g).bfloat16()}, ckpt / "s2.safetensors")
    good = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": good if weight_map is None
                                                                   else weight_map}))
    return good


def test_an_index_naming_one_shard_two_ways_packs(tmp_path):
    """'./s1.safetensors' and 's1.safetensors' are one file: it had been read twice and refused
    as 'tensor a is in two shards (./s1.safetensors and s1.safetensors)'."""
    ckpt = tmp_path / "ck"
    _sharded(ckpt, {"a": "./s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"})
    prepack(ckpt, tmp_path / "out", progress=False)
    _loads_as_safetensors_reads(ckpt, tmp_path / "out")


def test_index_disagreements_are_refused_or_packed_as_the_shards_hold(tmp_path):
    ckpt = tmp_path / "ck"
    good = _sharded(ckpt)
    index = ckpt / "model.safetensors.index.json"
    cases = [
        ({**good, "d": "s3.safetensors"}, rf"{index}: names shard\(s\) \['s3.safetensors'\] that do not exist"),
        ({**good, "a": "s2.safetensors"}, rf"{index}: maps 'a' to s2.safetensors, but it is in s1.safetensors"),
        ({**good, "z": "s1.safetensors"}, rf"{index}: maps 'z' to s1.safetensors, but no shard holds it"),
        ({}, rf"{index}: its weight_map names no tensor"),
        # a name no filesystem takes (ENAMETOOLONG) had escaped as a bare OSError (found by make fuzz)
        ({**good, "c": "m" * 300 + ".safetensors"}, r"cannot look up a shard model.safetensors.index.json names "
                                                     r"\(File name too long\)"),
    ]
    for i, (weight_map, message) in enumerate(cases):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(LayoutError, match=message):
            prepack(ckpt, tmp_path / f"out{i}", progress=False)
        assert not (tmp_path / f"out{i}").exists()
    # extra keys and a wrong total_size are not the index's truth; a tensor the index omits from a
    # shard it names is still packed (transformers loads every tensor of the shards it names)
    index.write_text(json.dumps({"metadata": {"total_size": 1}, "other": [1], "weight_map": {"a": "s1.safetensors",
                                                                                            "c": "s2.safetensors"}}))
    prepack(ckpt, tmp_path / "ok", progress=False)
    _loads_as_safetensors_reads(ckpt, tmp_path / "ok")


def test_every_dtype_safetensors_stores_packs_or_is_refused_by_name(tmp_path):
    """Each supported dtype as a matrix, an odd-length vector, a 0-dim scalar and two zero-element
    tensors loads back as safetensors reads it; each newer dtype is refused, named with its tensor."""
    from flashboot.layouts.format import DTYPES

    g = torch.Generator().manual_seed(4)
    tensors = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        base = torch.randn(3, 5, generator=g) * 10
        tensors.update({f"{name}.mat": base.to(dt), f"{name}.odd": base.reshape(-1)[:13].clone().to(dt),
                        f"{name}.scalar": torch.tensor(3.0).to(dt), f"{name}.empty": torch.zeros(0, 7).to(dt),
                        f"{name}.empty2": torch.zeros(4, 0, 2).to(dt)})
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    save_file(tensors, ckpt / "model.safetensors")
    prepack(ckpt, tmp_path / "out", progress=False)
    _loads_as_safetensors_reads(ckpt, tmp_path / "out")
    newer = {"uint16": "U16", "uint32": "U32", "uint64": "U64", "complex64": "C64", "float8_e8m0fnu": "F8_E8M0",
             "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ"}
    for i, (name, code) in enumerate(newer.items()):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        other = tmp_path / f"ck-{name}"
        other.mkdir()
        try:
            save_file({"ok": torch.ones(2), "x": torch.zeros(4, dtype=torch.uint8).view(dt) if dt.itemsize == 1
                       else torch.zeros(4).to(dt)}, other / "model.safetensors")
        except Exception:  # this safetensors does not store it
            continue
        with pytest.raises(LayoutError, match=rf"unsupported dtype in 1 tensor\(s\): x \({code}, in model.safetensors\)"):
            prepack(other, tmp_path / f"out-{i}", progress=False)
        assert not (tmp_path / f"out-{i}").exists()


def test_more_shards_than_open_files_allowed_pack(tmp_path):
    """Every shard had stayed open until the end of the job: a checkpoint of more shards than the
    process may open (1,024 by default) failed at the last ones with 'Too many open files'."""
    import os
    import resource

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    shards = 160
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"t.{i}": torch.full((3,), float(i)), f"u.{i}": torch.arange(i % 7, dtype=torch.int16)}, ckpt / name)
        weight_map.update({f"t.{i}": name, f"u.{i}": name})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = len(os.listdir("/proc/self/fd")) + 100  # fewer than the shards, enough for the job's own files
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
    try:
        prepack(ckpt, tmp_path / "out", progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _loads_as_safetensors_reads(ckpt, tmp_path / "out")


def test_a_hub_cache_repo_directory_is_refused_naming_its_snapshot(tmp_path):
    """``models--org--name`` given instead of its ``snapshots/REV``: 'no .safetensors files' had not
    said where they are."""
    repo = tmp_path / "models--org--name"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "snapshots" / "fedcba9876543210fedcba9876543210fedcba98").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    with pytest.raises(LayoutError, match=rf"{repo}: no .safetensors files \(a hub cache repo: its checkpoint is "
                                          rf"{repo / 'snapshots' / rev}\)"):
        prepack(repo, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
