import pytest

from flashboot import FlashBootError
from flashboot.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), (4096, 4096), ("217e9", 217_000_000_000), ("217GB", 217_000_000_000),
    ("256MiB", 256 << 20), ("256M", 256 << 20), ("1.5 GB", 1_500_000_000), ("1KiB", 1024),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-5", "0", "1.5B", "GB"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(FlashBootError):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(13_760_000_000) == "13.76 GB"
    assert format_bytes(12) == "12 B"
