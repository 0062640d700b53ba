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


def test_parse_bytes_is_exact_for_integers_beyond_a_float():
    # a float rounded this to 9007199254740992
    assert parse_bytes("9007199254740993") == 9007199254740993
    assert parse_bytes("9223372036854775807") == 2**63 - 1


@pytest.mark.parametrize("bad,match", [
    ("1e400", "larger than 9,223,372,036,854,775,807"),  # was a raw OverflowError
    ("9" * 5000, r"\(5002 characters\) is larger than"),  # was a raw OverflowError
    ("9223372036854775808", "larger than"),
    (2**64, "larger than"),
    ("1e99999999999999999999", "out of range"),
    ("1.00000000000000000000000000001", "not a whole number"),
])
def test_parse_bytes_refuses_huge_and_inexact_sizes(bad, match):
    with pytest.raises(FlashBootError, match=match):
        parse_bytes(bad)


def test_cli_model_bytes_too_large_is_an_error_not_a_traceback(capsys):
    from flashboot.cli import main

    assert main(["sim", "--topology", "h200-x2", "--schedule", "chain", "--clones", "2",
                 "--model-bytes", "1e400"]) == 2
    assert "larger than" in capsys.readouterr().err


def test_format_bytes_speaks_the_binary_units_the_options_take():
    assert format_bytes(13_760_000_000) == "12.81 GiB"
    assert format_bytes(12) == "12 B"
    for text in ("64MiB", "256MiB", "4KiB", "2GiB"):  # an option's value prints as it was written
        assert format_bytes(parse_bytes(text)).replace(" ", "") == text
    assert format_bytes(126_976) == "124 KiB"
