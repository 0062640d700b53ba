"""Refit from a hostile trainer's side: what a real RL trainer passes to ``publish`` (tensors in its
own order, meta tensors, non-tensors, temporaries) and what the engine then serves. Host backend."""

from __future__ import annotations

import json
import re

import pytest
import torch

import flashboot
from flashboot.weight_update import PublishError, Publisher

from _clone_helpers import _token, store  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def generic_image(tmp_path_factory):
    """A model with no family rules (the generic family: tensors verbatim, in checkpoint order)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("generic")
    (root / "ckpt").mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(_trainer_weights(0), root / "ckpt" / "model.safetensors")
    (root / "ckpt" / "config.json").write_text(json.dumps({"model_type": "tiny_bag", "_name_or_path": "org/tiny"}))
    flashboot.prepack(root / "ckpt", root / "img", progress=False)
    return root / "img"


def _trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    """As a trainer's named_parameters() gives them: in layer order (the checkpoint's is by name)."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(3, 5, generator=g) for i in range(12)}
    out["scale"] = torch.randn(8, 1, generator=g)  # a per-channel scale
    return out


def test_a_generic_image_takes_the_tensors_in_the_trainers_order(generic_image, store):
    """The generic family plans in source order: the trainer's order (layers 0..11) is not the
    checkpoint's (layers.0, layers.1, layers.10, ...); publish had refused every such publish
    ("lands at offset 512, the image has it at ...")."""
    address, _ = store
    new = _trainer_weights(1)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            pub.publish(list(reversed(new.items())), version=2)
            offsets = [p.dst_offset for p in pub.plan(new).pieces]
            assert offsets == sorted(offsets)  # PackPlan.pieces are in image order, as it says
            loaded.refit(address, 2, timeout_s=30)
        assert loaded.version == 2
        for name, t in new.items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()


def test_a_meta_tensor_is_refused_not_packed_from_address_zero(generic_image, store):
    """A parameter a trainer never materialized (deferred init) has data_ptr() 0: publish had packed
    whatever bytes the host read there and published them as the new weights."""
    new = _trainer_weights(2)
    new["layers.3.w"] = torch.empty(3, 5, device="meta")
    with Publisher(generic_image, 0, store=store[0], device="cpu") as pub:
        pub.arena.bytes().numpy()[:] = 0x5A
        with pytest.raises(PublishError, match=r"tensor 'layers\.3\.w' is a meta tensor .*nothing was written"):
            pub.publish(new, version=1)
        assert pub.version == 0 and pub.seed is None and (pub.arena.bytes().numpy() == 0x5A).all()


@pytest.mark.parametrize("bad", [None, [0.0] * 15, 1.5])
def test_a_value_that_is_not_a_tensor_is_named(generic_image, bad):
    """A state dict with a None (a parameter dropped) or a list: had been a raw AttributeError."""
    new = dict(_trainer_weights(3), **{"layers.4.w": bad})
    with Publisher(generic_image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False) as pub:
        with pytest.raises(PublishError, match=r"'layers\.4\.w' is a \w+, not a torch\.Tensor; nothing was written"):
            pub.publish(new, version=1)
        with pytest.raises(PublishError, match=r"tensor names are strings, got 4"):
            pub.publish([(4, torch.zeros(3, 5))], version=1)
        assert pub.version == 0 and pub.seed is None


def test_publish_keeps_no_reference_to_the_tensors_it_packed(generic_image, store):
    """A trainer that publishes per-step copies (a cast, a gathered full tensor) gets their memory
    back when publish returns: the cached table had held the last publish's tensors until the next
    one. Parameters updated in place still reuse the table and publish their new bytes."""
    import gc
    import weakref

    address, _ = store
    params = _trainer_weights(4)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            copies = {n: t.clone() for n, t in params.items()}
            ref = weakref.ref(copies["layers.0.w"])
            pub.publish(copies, version=1)
            del copies
            gc.collect()
            assert ref() is None
            pub.publish(params, version=2)
            table = pub._table[2]
            for t in params.values():
                t.mul_(-2)  # an optimizer step, in place
            pub.publish(params, version=3)
            assert pub._table[2] is table
            loaded.refit(address, 3, timeout_s=30)
        for name, t in params.items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()



def test_a_refused_publish_keeps_no_reference_to_the_tensors_it_was_given(generic_image, store):
    """A publish refused after its table was built (the version claimed by another Publisher) kept
    the trainer's per-step copies (a full model's gathered tensors) alive until the next publish
    or close, through whatever the trainer did after catching the error."""
    import gc
    import weakref

    from flashboot.weight_update import PublishError

    address, _ = store
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as first, \
                Publisher(generic_image, 0, store=address, device="cpu") as pub:
            first.publish(_trainer_weights(5), version=1)
            copies = {n: t.clone() for n, t in _trainer_weights(6).items()}
            refs = [weakref.ref(t) for t in copies.values()]
            with pytest.raises(PublishError, match="version 1 was already published"):
                pub.publish(copies, version=1)
            del copies
            gc.collect()
            assert [r for r in refs if r() is not None] == []
            pub.publish(_trainer_weights(6), version=2)  # the next publish packs as ever
            loaded.refit(address, 2, timeout_s=30)
        for name, t in _trainer_weights(6).items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()

def test_a_column_viewed_as_n_by_1_publishes_its_own_bytes(generic_image, store):
    """``scales[:, 3].view(-1, 1)`` has strides (10, 10): the size-1 dim's stride had merged the
    column into one contiguous run, publishing row 0's ten neighbours of it, without an error."""
    from flashboot.weight_update.plan import box_runs

    column = torch.arange(80.0).reshape(8, 10)[:, 3].view(-1, 1)
    assert column.stride() == (10, 10)
    assert box_runs((8, 1), (10, 10), 4, ((0, 8), (0, 1)), 0, 0, "t") == [(0, 0, 32, 4, 40)]
    assert box_runs((8, 1), (1, 1), 4, ((0, 8), (0, 1)), 0, 0, "t") == [(0, 0, 32, 32, 32)]  # contiguous: one run
    address, _ = store
    new = dict(_trainer_weights(5), scale=column)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            pub.publish(new, version=1)
            loaded.refit(address, 1, timeout_s=30)
        assert torch.equal(loaded.tensors["scale"], column)
    finally:
        loaded.close()


def test_two_refits_of_one_engine_at_once_never_go_back_a_version(generic_image, store, monkeypatch):
    """Two trainers published versions 1 and 2; two update requests reach the engine at once. Both
    had passed the version check against live version 0 and the one that finished last went
    live: version 1 over version 2. One refit at a time: version 1 is then refused as older."""
    import threading

    import flashboot.flashclone.cloning as cloning
    from flashboot.weight_update import RefitError

    address, _ = store
    real_clone = cloning.clone
    v2_cloning, v1_cloning, v2_done = threading.Event(), threading.Event(), threading.Event()

    def clone(*args, **kwargs):
        if kwargs["name"].endswith(".v2"):
            v2_cloning.set()
            v1_cloning.wait(3)  # version 1's copy under way (it never is, while version 2's refit runs)
        else:
            v1_cloning.set()
            v2_done.wait(10)
        return real_clone(*args, **kwargs)

    monkeypatch.setattr(cloning, "clone", clone)
    one, two = _trainer_weights(6), _trainer_weights(7)
    loaded = flashboot.load(generic_image, device="cpu")
    outcome = {}

    def refit(version):
        try:
            outcome[version] = loaded.refit(address, version, timeout_s=30).version
        except RefitError as exc:
            outcome[version] = str(exc)
        finally:
            if version == 2:
                v2_done.set()

    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as a, \
                Publisher(generic_image, 0, store=address, device="cpu") as b:
            a.publish(one, version=1)
            b.publish(two, version=2)
            first = threading.Thread(target=refit, args=(2,))
            first.start()
            assert v2_cloning.wait(30)
            second = threading.Thread(target=refit, args=(1,))
            second.start()
            for t in (first, second):
                t.join(30)
        assert outcome[2] == 2 and "version 1 is not newer than the live version 2" in str(outcome[1]), outcome
        assert loaded.version == 2
        for name, t in two.items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()


class _Wrapper(torch.Tensor):
    """A tensor subclass that wraps another, as DTensor (FSDP2's parameters) does: the global shape
    and dtype, no storage of its own, data_ptr() 0."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)

    def full_tensor(self):
        return self.inner


@pytest.mark.parametrize("kind", ["wrapper", "sparse"])
def test_a_tensor_without_data_of_its_own_is_refused(generic_image, store, kind):
    """A DTensor's data_ptr() is 0 as a meta tensor's is: publish had packed from address 0."""
    new = _trainer_weights(8)
    t = new["layers.5.w"]
    new["layers.5.w"] = _Wrapper(t) if kind == "wrapper" else t.to_sparse()
    with Publisher(generic_image, 0, store=store[0], device="cpu") as pub:
        pub.arena.bytes().numpy()[:] = 0x5A
        want = (r"_Wrapper of layout torch\.strided .*; pass t\.full_tensor\(\)" if kind == "wrapper" else
                r"Tensor of layout torch\.sparse_coo .*; pass a plain strided tensor")
        with pytest.raises(PublishError, match=r"'layers\.5\.w' is a " + want + "; nothing was written"):
            pub.publish(new, version=1)
        assert pub.version == 0 and pub.seed is None and (pub.arena.bytes().numpy() == 0x5A).all()


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"bf": torch.randn(4, 6, generator=g).bfloat16(),
            "f8": torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn), "mask": torch.randn(7, generator=g) > 0,
            "ids": torch.randint(0, 1000, (3, 3), generator=g),
            "empty": torch.zeros(0, 4), "scalar": torch.randn((), generator=g), "half": torch.randn(2, 2, 2).half()}


def test_empty_scalar_fp8_bool_tensors_and_strided_views_publish_their_bytes(tmp_path, store):
    """An image with an empty tensor (a placeholder buffer): publish had refused the empty tensor
    given as "not in the manifest" (it makes no table row). The others come as a trainer holds
    them: strided views of one storage, a parameter that requires grad, a 0-d scalar."""
    from safetensors.torch import save_file

    (tmp_path / "ckpt").mkdir()
    save_file(_mixed(0), tmp_path / "ckpt" / "model.safetensors")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "tiny_bag", "_name_or_path": "org/m"}))
    flashboot.prepack(tmp_path / "ckpt", tmp_path / "img", progress=False)
    new = _mixed(1)
    want = {n: t.clone() for n, t in new.items()}
    shared = torch.zeros(8, 6, dtype=torch.bfloat16)
    shared[::2] = new["bf"]
    new["bf"] = shared[::2]
    half = torch.zeros(2, 4, 2, dtype=torch.half)
    half[:, 1::2] = new["half"]
    new["half"] = half[:, 1::2]
    new["scalar"] = torch.nn.Parameter(new["scalar"])
    address, _ = store
    loaded = flashboot.load(tmp_path / "img", device="cpu")
    try:
        for version, order in ((1, list(new.items())), (2, list(reversed(new.items())))):
            with Publisher(tmp_path / "img", 0, store=address, device="cpu") as pub:  # each plans its order
                pub.publish(order, version=version)  # the empty tensor given before, then after its neighbour
                loaded.refit(address, version, timeout_s=30)
        for name, t in want.items():
            got = loaded.tensors[name]
            raw = [x.reshape(-1).view(torch.uint8) for x in (got, t)]  # fp8 has no equal(); 0-d has no byte view
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(*raw), name
    finally:
        loaded.close()


def test_two_publishes_at_once_from_one_publisher_do_not_mix(generic_image, store, monkeypatch):
    """A trainer publishing from a background thread while the last publish still runs: both had
    packed into the one arena at once, each record's checksums then vouched for whichever bytes
    were there (version 1's record served version 2's weights, verified), the publisher's version
    went back to 1 and one seed was never withdrawn. One at a time: version 2 is what serves."""
    import threading
    import time

    import flashboot.flashclone.seeding as seeding
    import flashboot.weight_update.pack as pack

    address, _ = store
    seeds, real_seed, real_pack = [], seeding.seed, pack.pack_rows_host

    def slow_pack(rows):
        time.sleep(0.3)  # both publishes in their pack at once, unless one waits for the other
        real_pack(rows)

    def seed(*args, **kwargs):
        seeds.append(real_seed(*args, **kwargs))
        return seeds[-1]

    monkeypatch.setattr(pack, "pack_rows_host", slow_pack)
    monkeypatch.setattr(seeding, "seed", seed)
    weights = {1: _trainer_weights(9), 2: _trainer_weights(10)}
    outcome = {}
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            def publish(version):
                try:
                    outcome[version] = pub.publish(weights[version], version).version
                except PublishError as exc:
                    outcome[version] = str(exc)

            threads = [threading.Thread(target=publish, args=(v,)) for v in (1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert outcome[2] == 2 and pub.version == 2, outcome
            loaded.refit(address, 2, timeout_s=30)
        for name, t in weights[2].items():
            assert torch.equal(loaded.tensors[name], t), name
        assert seeds and all(s._closed for s in seeds)
    finally:
        loaded.close()


def test_a_failed_in_place_refit_ends_the_post_processing_retry_of_the_last_version(tmp_path, store):
    """Version 1's post-processing failed (its retry is pending: "refit to version 1 again"), then
    an in-place refit to version 2 failed mid-way (the arena a mix of 1 and 2). The pending retry
    had then run version 1's post-processing over the mix and reported success."""
    from test_integrations_refit import TinyEngineModel, _key, _prepack, _serve, _tensors

    from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish, refit_engine_model
    from flashboot.weight_update import RefitError

    def fail():
        raise RuntimeError("reprocess failed")

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    options = dict(what="test refit", derive=model.post_load_weights, timeout_s=30)
    try:
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            pub.publish(dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu")), version=1)
            with pytest.raises(RefitError, match="version 1's bytes are live but .* failed at reprocess"):
                refit_engine_model(model, address, 1, reprocess=fail, **options)
            pub.publish(dict(engine_tensors_to_publish(TinyEngineModel(2), "cpu")), version=2)
            pub.arena.bytes().numpy()[:64] ^= 0xFF  # the copy fails its checksums after landing in place
            with pytest.raises(RefitError, match="atomic=False, in place.*may hold a mix of versions 1 and 2"):
                refit_engine_model(model, address, 2, atomic=False, **options)
            with pytest.raises(RefitError, match="version 1 is not newer than version 1, the last whole one"):
                refit_engine_model(model, address, 1, **options)
        assert weights.post_refit_pending is None and weights.handle.version is None
        assert not torch.equal(_tensors(model)["qkv.weight"], TinyEngineModel(1).qkv.weight)  # not version 1's
    finally:
        weights.close()


def test_an_in_place_refit_that_fails_before_writing_keeps_the_post_processing_retry(tmp_path, store):
    """Version 1's post-processing failed (its retry pending), then an in-place refit to version 2
    failed before a byte was written (a transport the trainer does not serve): the arena still held
    version 1's bytes, but the pending retry was dropped, and "refit to version 1 again", as the
    error had said, was refused as not newer: only a reload could make the engine servable."""
    from test_integrations_refit import TinyEngineModel, _key, _prepack, _serve

    from flashboot.errors import RendezvousError
    from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish, refit_engine_model
    from flashboot.weight_update import RefitError

    failed = []

    def fail_once():
        if not failed:
            failed.append(1)
            raise RuntimeError("reprocess failed")

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    one = dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu"))
    options = dict(what="test refit", derive=model.post_load_weights, reprocess=fail_once, timeout_s=30)
    try:
        with engine_publisher(image, 0, store=address, device="cpu") as pub:
            pub.publish(one, version=1)
            with pytest.raises(RefitError, match="version 1's bytes are live but .* failed at reprocess"):
                refit_engine_model(model, address, 1, **options)
            pub.publish(dict(engine_tensors_to_publish(TinyEngineModel(2), "cpu")), version=2)
            with pytest.raises(RendezvousError, match="transport nccl cannot serve this clone"):
                refit_engine_model(model, address, 2, atomic=False, transport="nccl", **options)
            assert weights.handle.version == 1 and weights.post_refit_pending == {"version": 1, "derived": ["w_kc"]}
            report = refit_engine_model(model, address, 1, **options)  # the retry the first error named
            assert report.details["post_processing_only"] and weights.post_refit_pending is None
            assert torch.equal(model.qkv.weight, one["qkv.weight"])
            assert torch.equal(model.w_kc, one["qkv.weight"][:4, :8] * 2)
    finally:
        weights.close()


def test_a_publisher_that_hosts_the_store_keeps_it_from_one_version_to_the_next(generic_image):
    """No store listens: the first publish's seed hosted it, and the next publish, withdrawing
    that seed, took the store down with every record in it: another rank's publish (here another
    name) was gone, and engines waiting for the next version lost the store."""
    from flashboot.flashclone.rendezvous import free_port

    address = f"127.0.0.1:{free_port()}"
    one, two, other = _trainer_weights(11), _trainer_weights(12), _trainer_weights(13)
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub, \
                Publisher(generic_image, 0, store=address, device="cpu", name="other") as neighbour:
            pub.publish(one, version=1)
            neighbour.publish(other, version=1)
            pub.publish(two, version=2)
            loaded.refit(address, 1, name="other", timeout_s=5)
            for name, t in other.items():
                assert torch.equal(loaded.tensors[name], t), name
            loaded.refit(address, 2, timeout_s=5)
        for name, t in two.items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()


def test_a_refit_after_the_engine_closed_its_weights_says_so(tmp_path, store):
    """It had said the model "was not loaded by the flashboot loader (start the engine with
    --load-format flashboot)" of a model that was, and whose weights were closed since."""
    from test_integrations_refit import TinyEngineModel, _key, _prepack, _serve

    from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish, refit_engine_model
    from flashboot.weight_update import RefitError

    address, _ = store
    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    model, weights = _serve(image, tmp_path / "shm", _key())
    weights.close()
    with engine_publisher(image, 0, store=address, device="cpu") as pub:
        pub.publish(dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu")), version=1)
        with pytest.raises(RefitError, match=r"test refit: the weights of TinyEngineModel were released \(their "
                                             r"arena is closed.*nothing was copied"):
            refit_engine_model(model, address, 1, what="test refit", timeout_s=30)


def test_a_publish_after_close_says_the_publisher_is_closed(generic_image):
    pub = Publisher(generic_image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False)
    pub.close()
    with pytest.raises(PublishError, match=r"publish of version 1: this Publisher was closed .*make a new one"):
        pub.publish(_trainer_weights(14), version=1)
    pub.close()  # idempotent


def test_a_tied_tensor_given_only_by_its_other_name_is_named(tmp_path):
    """A trainer's own dict names the tied head 'lm_head.weight'; the image stores it as
    'embed.weight' ('lm_head.weight' its alias): the refusal had only said 'embed.weight' was missing."""
    from test_integrations_refit import TinyEngineModel, _key, _prepack

    from flashboot.integrations.engine_refit import engine_publisher, engine_tensors_to_publish

    image = _prepack(TinyEngineModel(0), tmp_path / "img", _key())
    new = dict(engine_tensors_to_publish(TinyEngineModel(1), "cpu"))
    new["lm_head.weight"] = new.pop("embed.weight")
    with engine_publisher(image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False) as pub:
        with pytest.raises(PublishError, match=r"'embed\.weight' get no bytes: .*; 'lm_head\.weight', given, is "
                                               r"another name of 'embed\.weight': give it as 'embed\.weight'; nothing"):
            pub.publish(new, version=1)


def test_a_config_that_is_not_config_json_is_named(generic_image):
    """``config=model.config`` (an object) had been a raw ValueError of dict(); a config dict with
    transformers' defaults added was called "another model" without saying which keys differ."""
    import types

    raw = json.loads((generic_image.parent / "ckpt" / "config.json").read_text())
    opts = dict(store="127.0.0.1:1", device="cpu", token="x" * 16, host_store=False)
    with Publisher(generic_image, 0, config=types.SimpleNamespace(**raw), **opts) as pub:
        with pytest.raises(PublishError, match=r"config must be the model's config\.json as a dict, got a "
                                               r"SimpleNamespace"):
            pub.plan(_trainer_weights(15))
    with Publisher(generic_image, 0, config=dict(raw, use_cache=True), **opts) as pub:
        with pytest.raises(PublishError, match=r"another model, or not the config\.json it was pre-packed from; keys "
                                               r"that differ from .*config\.json: \['use_cache'\]\)"):
            pub.plan(_trainer_weights(15))


@pytest.mark.parametrize("timeout_s", [None, float("nan"), 0, -1, "5"])
def test_a_bad_publisher_timeout_is_refused_at_once(generic_image, timeout_s):
    """It had surfaced at the first publish, after the pack: a raw TypeError or ValueError, or
    "cannot host a store ...: Bad file descriptor" for 0."""
    with pytest.raises(PublishError, match=r"Publisher timeout_s must be a finite number of seconds in \(0, "):
        Publisher(generic_image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, timeout_s=timeout_s)


@pytest.mark.parametrize("name", [3, None, "", "trainer/0"])
def test_a_bad_publisher_name_is_refused_at_once(generic_image, name):
    """The name is the store's namespace: 3 or None had been a raw TypeError at the first publish
    (after the plan), '' or one with '/' the store's error about a namespace."""
    with pytest.raises(PublishError, match=rf"Publisher name must be a non-empty string without '/' .*got "
                                           rf"{re.escape(repr(name))}"):
        Publisher(generic_image, 0, store="127.0.0.1:1", device="cpu", token="x" * 16, name=name)


def test_a_publisher_hosts_the_store_once_its_host_has_left(generic_image):
    """Trainer A hosted the store, B joined it; A left (the store with it). B's next seed hosted a
    new store, and B's publish after that, withdrawing that seed, took it down again with a third
    publisher's record: B had asked whether to host only once, when A still did."""
    from flashboot.flashclone.rendezvous import free_port

    address = f"127.0.0.1:{free_port()}"
    opts = dict(store=address, device="cpu")
    loaded = flashboot.load(generic_image, device="cpu")
    third = _trainer_weights(18)
    try:
        with Publisher(generic_image, 0, name="b", **opts) as b:
            with Publisher(generic_image, 0, name="a", **opts) as a:
                a.publish(_trainer_weights(16), version=1)
                b.publish(_trainer_weights(17), version=1)
            b.publish(_trainer_weights(17), version=2)  # the store A hosted is gone: B hosts one
            with Publisher(generic_image, 0, name="c", **opts) as c:
                c.publish(third, version=1)
                b.publish(_trainer_weights(17), version=3)
                loaded.refit(address, 1, name="c", timeout_s=5)
        for name, t in third.items():
            assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()


@pytest.mark.parametrize("then", ["close", "sleep"])
def test_a_close_or_sleep_during_a_refits_copy_waits_for_it(generic_image, store, monkeypatch, then):
    """An engine shutting down (close) or going to sleep (RL's rollout/train switch) from another
    thread while a refit copies into its arena: neither waited, and the arena was released under
    the copy (a segfault on the host backend; on CUDA, writes into unmapped memory). They now wait
    for the copy, and the refit's version goes live first."""
    import threading

    import flashboot.flashclone.cloning as cloning

    address, _ = store
    real_clone = cloning.clone
    copying, finish = threading.Event(), threading.Event()

    def clone(*args, **kwargs):
        copying.set()
        finish.wait(30)
        return real_clone(*args, **kwargs)

    monkeypatch.setattr(cloning, "clone", clone)
    weights = _trainer_weights(8)
    loaded = flashboot.load(generic_image, device="cpu")
    outcome = {}
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as trainer:
            trainer.publish(weights, version=1)
            refit = threading.Thread(target=lambda: outcome.setdefault("refit", loaded.refit(address, 1, timeout_s=30)))
            refit.start()
            assert copying.wait(30)
            other = threading.Thread(target=getattr(loaded, then))
            other.start()
            other.join(0.5)
            assert other.is_alive() and not loaded.arena.closed and not loaded.arena.asleep, \
                f"{then}() released the arena under the refit's copy"
            finish.set()
            refit.join(30)
            other.join(30)
        assert outcome["refit"].version == 1 and loaded.version == 1
        assert loaded.arena.closed if then == "close" else loaded.arena.asleep
    finally:
        finish.set()
        loaded.close()


def test_a_publish_whose_images_config_json_is_nested_too_deeply_is_refused_by_name(tmp_path):
    """The config.json beside the checkpoint an image was pre-packed from, read when a Publisher
    is given no config=: one nested too deeply raised RecursionError (no ValueError) raw."""
    from types import SimpleNamespace

    from flashboot.weight_update.plan import _config_for

    (tmp_path / "config.json").write_text("[" * 100_000)
    metadata = SimpleNamespace(source=SimpleNamespace(path=str(tmp_path)))
    with pytest.raises(PublishError, match="config.json: not JSON \\(nested deeper than this reader accepts\\)"):
        _config_for(metadata, None, "publish")


def test_a_lazy_negative_view_is_refused_not_published_with_the_wrong_sign(generic_image, store):
    """A lazy neg view (a complex buffer's ``.conj().imag``, ``_neg_view()``) shares its tensor's
    address and strides: its memory holds the values un-negated. Publish had packed those bytes
    and the engine served the weights with the wrong sign, no error; a second publish at the same
    addresses (the cached table) skipped every check of the tensors."""
    address, _ = store
    params = _trainer_weights(5)
    neg = torch.randn(3, 5)._neg_view()
    assert neg.is_neg() and torch.randn(3, 5, dtype=torch.complex64).conj().imag.is_neg()
    loaded = flashboot.load(generic_image, device="cpu")
    try:
        with Publisher(generic_image, 0, store=address, device="cpu") as pub:
            with pytest.raises(PublishError, match=r"'layers\.2\.w' is a lazy negative view .*resolve_neg"):
                pub.publish(dict(params, **{"layers.2.w": neg}), version=1)
            pub.publish(params, version=1)
            loaded.refit(address, 1, timeout_s=30)
            with pytest.raises(PublishError, match=r"'layers\.2\.w' is a lazy negative view"):
                pub.publish(dict(params, **{"layers.2.w": params["layers.2.w"]._neg_view()}), version=2)
            assert pub.version == 1
            pub.publish(dict(params, **{"layers.2.w": neg.resolve_neg()}), version=2)
            loaded.refit(address, 2, timeout_s=30)
        assert torch.equal(loaded.tensors["layers.2.w"], neg)
        for name, t in params.items():
            if name != "layers.2.w":
                assert torch.equal(loaded.tensors[name], t), name
    finally:
        loaded.close()
