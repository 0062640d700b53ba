"""The load sources' registry and the choice among them (pure Python: no image is read), and one
invariant over every registered source on real data: it fills the arena with the image's bytes,
prepared and plain (host backend, a served-load daemon in its own process).

Each source's own cases run in test_load.py (pinned, served), test_stream.py (disk) and
test_boot.py (each source's early copy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _io_helpers import image, image_master, shm  # noqa: F401  (fixtures)
from flashboot.layouts import read_image
from test_boot import daemon  # noqa: F401  (fixture: a served-load daemon holding rank 0)

import flashboot
from flashboot.errors import FlashBootError
from flashboot.flashload.choose import choose, choose_prepared
from flashboot.flashload.prepared import MODES
from flashboot.flashload.sources import Offer, Source, register_source, registered_sources, source_for_mode
from flashboot.flashload.sources import base as sources_base
from flashboot.flashload.want import Want


def _daemon(running: bool, serve: bool, pid: int = 4242):
    return SimpleNamespace(running=running, serve=serve, pid=pid)


def test_every_mode_of_prepare_is_one_registered_source_and_back():
    sources = registered_sources()
    assert [s.name for s in sources] == ["served", "disk", "pinned"]  # the order choose asks them in
    assert sorted(s.mode for s in sources) == sorted(m for m in MODES if m != "auto")
    for source in sources:
        assert source_for_mode(source.mode) is source


@pytest.mark.parametrize("status", [None, _daemon(False, False), _daemon(True, False), _daemon(True, True)])
def test_every_source_answers_an_offer_with_a_reason(status):
    want = Want("/images/x", 0, source=None, stream=False, daemon=status)  # stream=False: no file is looked at
    for source in registered_sources():
        offer = source.offer(want)
        assert isinstance(offer, Offer) and isinstance(offer.fits, bool) and offer.why, source


def test_choose_takes_the_first_that_fits_and_says_why_not_the_others():
    serving = Want("/images/x", 0, source=None, stream=False, daemon=_daemon(True, True, pid=77))
    source, why, why_not = choose(serving)
    assert source.name == "served" and why == "a served-load daemon runs (pid 77)" and why_not == {}

    streamed = Want("/images/x", 0, source=None, stream=True, daemon=_daemon(True, False))
    source, why, why_not = choose(streamed)
    assert source.name == "disk" and why == "stream=True was asked"
    assert why_not == {"served": "no served-load daemon runs"}

    plain = Want("/images/x", 0, source=None, stream=False)  # a plain load: the daemon only by served=True
    source, why, why_not = choose(plain)
    assert source.name == "pinned" and why == "the staged copy is (or will be) in shared memory"
    assert set(why_not) == {"served", "disk"} and "served=True" in why_not["served"]

    preloader = Want("/images/x", 0, source=None, stream=False, daemon=_daemon(True, False, pid=9))
    assert choose(preloader)[1] == "a preloader without --serve runs (pid 9): pinning its staged copy here"


def test_a_mode_asked_for_is_taken_without_asking_the_daemon():
    source, why = choose_prepared("stream", None, None)  # nothing read: no image exists
    assert source.name == "disk" and why == "asked for"


def test_the_registry_refuses_clashes_and_names_what_it_knows(monkeypatch):
    monkeypatch.setattr(sources_base, "_SOURCES", dict(sources_base._SOURCES))  # registrations here are undone

    with pytest.raises(FlashBootError, match="source Nameless has no name"):
        register_source(type("Nameless", (Source,), {"mode": "nameless"}))
    with pytest.raises(FlashBootError, match=r"clashes with <source 'disk'>"):
        register_source(type("Disk2", (Source,), {"name": "disk2", "mode": "stream"}))
    with pytest.raises(FlashBootError, match="no load source has the mode 'peer'; known: served, staged, stream"):
        source_for_mode("peer")

    class Refusing(Source):
        name, mode, order = "refusing", "refusing", -1

        def offer(self, want):
            return Offer(False, "never fits")

    register_source(Refusing)
    assert registered_sources()[0].name == "refusing" and source_for_mode("refusing").name == "refusing"
    source, _, why_not = choose(Want("/images/x", 0, source=None, stream=True))
    assert source.name == "disk" and why_not["refusing"] == "never fits"


def test_no_source_fitting_is_an_error_naming_each_reason(monkeypatch):
    class Never(Source):
        name, mode = "never", "never"

        def offer(self, want):
            return Offer(False, "not today")

    monkeypatch.setattr(sources_base, "_SOURCES", {})
    register_source(Never)
    with pytest.raises(FlashBootError, match="no load source fits rank 3 of /images/x: never: not today"):
        choose(Want("/images/x", 3, source=None))


PLAIN_LOAD = {"served": ({"served": True}, "served"), "pinned": ({}, "host"),
              "disk": ({"stream": True}, "streamed from disk")}
"""How a plain load reaches each registered source, and the report's mode on the host backend
(pinned: the daemon staged the rank, so the choice takes the staged copy)."""


def test_every_registered_source_fills_the_arena_with_the_image_prepared_and_plain(image, shm, daemon):
    expected = read_image(image, 0).path.read_bytes()
    assert set(PLAIN_LOAD) == {s.name for s in registered_sources()}  # a new source adds its case here
    for source in registered_sources():
        handle = flashboot.prepare(image, 0, "cpu", mode=source.mode, shm_dir=shm)
        with handle.load(verify=True) as loaded:
            assert handle.load_source is source and handle.why == "asked for"
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == expected, source
            assert loaded.report.details["verified"].startswith(f"{len(loaded.metadata.checksums.digests)} chunks")
        options, mode = PLAIN_LOAD[source.name]
        with flashboot.load(image, 0, "cpu", shm_dir=shm, verify=True, **options) as loaded:
            assert loaded.report.mode == mode
            assert bytes(loaded.arena.bytes()[:loaded.nbytes].numpy()) == expected, source
            assert "verified" in loaded.report.details, source
