import pytest

from flashboot import CapabilityError, Device, FlashBootError
from flashboot.memory import Span, path_between


def test_device_parse_cpu_forms():
    assert Device.parse("cpu") == Device("cpu")
    assert str(Device.parse("CPU")) == "cpu"


def test_device_parse_rejects_garbage():
    with pytest.raises(FlashBootError, match="cannot parse device 'gpu7'"):
        Device.parse("gpu7")


def test_device_parse_missing_cuda_device_names_count(monkeypatch):
    import flashboot._cuda as c

    if c.cuda_available():
        n = c.device_count()
        with pytest.raises(CapabilityError, match=f"has {n} CUDA device"):
            Device.parse(n + 3)
    else:
        with pytest.raises(CapabilityError, match="no CUDA device"):
            Device.parse("cuda:0")


def test_paths():
    c0, c1, h = Device("cuda", 0), Device("cuda", 1), Device("cpu")
    assert path_between(h, c0) == "h2d"
    assert path_between(c0, h) == "d2h"
    assert path_between(c0, c0) == "d2d"
    assert path_between(c0, c1) == "p2p"
    assert path_between(h, h) == "host"


def test_span_sub_bounds():
    s = Span(4096, 100, Device("cpu"))
    assert s.sub(10, 20).ptr == 4106
    with pytest.raises(FlashBootError, match=r"\[90, 110\) is outside the 100-byte span"):
        s.sub(90, 20)
