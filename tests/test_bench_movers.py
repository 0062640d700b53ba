"""``bench movers --chunked`` refuses plainly without a GPU (it measures GPU copies only)."""

import pytest

from flashboot._cuda import cuda_available


@pytest.mark.skipif(cuda_available(), reason="checks the refusal on machines without CUDA")
def test_chunked_mode_without_cuda_says_why(capsys):
    from flashboot.cli import main

    try:
        rc = main(["bench", "movers", "--chunked", "--chunks", "1MiB", "--chain-bytes", "none"])
    except SystemExit as exc:
        rc = exc.code
    assert rc != 0
    assert "bench movers --chunked measures GPU copies and needs a CUDA device" in capsys.readouterr().err
