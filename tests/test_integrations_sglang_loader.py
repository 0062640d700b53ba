"""FlashBoot as an SGLang model loader (flashboot.integrations.sglang): the plugin entry point, and
real SGLang in a child process (SGLang patches transformers on import, so it never enters this
process): its plugin loader and command-line parser take ``--load-format flashboot``, the pre-pack
runs SGLang's own ``DefaultModelLoader``, the load binds SGLang's model to one arena, an image of
another key is refused. The child process is the ``sglang_run`` fixture (conftest.py); its tests
are skipped only where SGLang is not installed (the CPU CI venv); docs/engines.md says how to build
the venv they run in.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from _engine_helpers import HAVE_SGLANG, assert_restarted_from_the_holder
from flashboot.errors import CapabilityError


def test_sglang_entry_point_resolves_to_the_plugin():
    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "flashboot"]
    assert [e.value for e in eps] == ["flashboot.integrations:sglang_plugin"]
    from flashboot.integrations import sglang_plugin

    assert eps[0].load() is sglang_plugin


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed: the plugin runs in test_real_sglang_*")
def test_sglang_plugin_without_sglang_says_so():
    from flashboot.integrations import sglang_plugin

    with pytest.raises(CapabilityError, match="the flashboot sglang plugin needs sglang importable"):
        sglang_plugin()


def test_real_sglang_plugin_makes_load_format_flashboot_valid(sglang_run):
    r = sglang_run
    assert r["choices_have_flashboot"] and r["cli_load_format"] == "flashboot" and r["cli_loader_class"]
    assert r["prepack_loader"] == "FlashBootModelLoader"


def test_real_sglang_prepack_runs_its_own_loader_and_dumps_every_tensor(sglang_run):
    r = sglang_run
    assert r["reference_loader"] == "DefaultModelLoader" and r["prepack_same_as_reference"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in r["param_names"]  # SGLang's fused names
    # named_buffers() lists the rotary cache both layers share once; the image writes it once and
    # keeps the second layer's name as an alias
    assert r["prepack_tensors"] == len(r["param_names"]) + len(r["buffer_names"]) and r["prepack_aliases"] == 1


def test_real_sglang_load_binds_the_engine_model_to_one_arena(sglang_run):
    r = sglang_run
    assert r["model_class"] == "LlamaForCausalLM" and r["how"] == "load"
    assert r["load_same_as_reference"] and r["all_in_one_arena"] and r["no_meta"] and r["weight_loader_kept"]
    key = r["key"]
    assert key["engine"] == "sglang" and key["engine_version"] == r["sglang_version"]
    assert key["dtype"] == "float32" and key["tp_size"] == 1 and key["architecture"] == "LlamaForCausalLM"
    assert key["gpu_arch"] == ("cpu" if r["device"] == "cpu" else key["gpu_arch"])


def test_real_sglang_restarts_from_a_holder_without_a_copy(sglang_run):
    assert_restarted_from_the_holder(sglang_run["restart"])


def test_real_sglang_refuses_an_image_of_another_key(sglang_run):
    r = sglang_run
    for case in ("mismatch", "auto_mismatch"):
        kind, msg = r[case]
        assert kind == "LayoutError", msg
        assert "dtype: engine 'bfloat16', image 'float32'" in msg and r["key"]["digest"][:19] in msg
