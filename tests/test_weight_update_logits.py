"""After a refit, a model bound to the arena views computes the logits of a from-scratch load of
the new weights, bit for bit (host backend here; the same test on a GPU where one exists)."""

from __future__ import annotations

import shutil

import pytest
import torch

import flashboot
from flashboot.weight_update import Publisher

from _clone_helpers import _token, store  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(180)

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def _model(ckpt, loaded):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    flashboot.bind(model, loaded)
    return model.eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atomic", [True, False])
def test_logits_after_refit_equal_a_fresh_load(tmp_path, store, device, atomic):
    from safetensors.torch import load_file, save_file

    from flashboot.layouts.tiny import save_tiny_model

    address, _ = store
    save_tiny_model("llama", tmp_path / "ckpt", dtype=torch.bfloat16)
    flashboot.prepack(tmp_path / "ckpt", tmp_path / "img", progress=False, chunk_bytes=64 << 10)
    old = load_file(tmp_path / "ckpt" / "model.safetensors")
    g = torch.Generator().manual_seed(11)
    new = {n: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in old.items()}
    (tmp_path / "new").mkdir()
    shutil.copy(tmp_path / "ckpt" / "config.json", tmp_path / "new" / "config.json")
    save_file(new, tmp_path / "new" / "model.safetensors")
    flashboot.prepack(tmp_path / "new", tmp_path / "img-new", progress=False, chunk_bytes=64 << 10)
    tokens = torch.randint(0, 128, (2, 16), generator=g).to(device)

    loaded = flashboot.load(tmp_path / "img", rank=0, device=device)
    fresh = flashboot.load(tmp_path / "img-new", rank=0, device=device)
    try:
        model = _model(tmp_path / "ckpt", loaded)
        with torch.no_grad():
            before = model(tokens).logits.clone()
        with Publisher(tmp_path / "img", 0, store=address, device=device) as pub:
            pub.publish([(n, t.to(device)) for n, t in reversed(list(new.items()))], version=1)
            loaded.refit(address, 1, atomic=atomic, timeout_s=60)
        with torch.no_grad():
            after = model(tokens).logits
            want = _model(tmp_path / "new", fresh)(tokens).logits
        assert not torch.equal(before, after)  # the weights did change under the bound model
        assert torch.equal(after, want)
    finally:
        loaded.close()
        fresh.close()
