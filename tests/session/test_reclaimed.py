"""Reclaimed session ids (session/reclaimed.py): bounded in count and age, oldest first."""

from __future__ import annotations

from sessiongate.session.reclaimed import ReclaimedIds


def test_an_id_is_gone_until_its_ttl_then_forgotten() -> None:
    ids = ReclaimedIds(limit=10, ttl=60.0)
    ids.add("a", 1000.0)
    assert ids.age("a", 1030.0) == 30.0
    assert ids.age("b", 1030.0) is None  # never deleted: a 404, not a 410
    assert ids.age("a", 1060.0) is None
    assert len(ids) == 0


def test_the_oldest_ids_go_first_past_the_limit() -> None:
    ids = ReclaimedIds(limit=3, ttl=3600.0)
    for n in range(5):
        ids.add(f"s{n}", 1000.0 + n)
    assert [i for i, _ in ids.entries(1010.0)] == ["s2", "s3", "s4"]
    ids.add("s2", 1020.0)  # deleted again: newest now
    assert [i for i, _ in ids.entries(1021.0)] == ["s3", "s4", "s2"]


def test_created_again_is_no_longer_gone_and_off_means_none() -> None:
    ids = ReclaimedIds(limit=3, ttl=3600.0)
    ids.add("a", 1.0)
    ids.discard("a")
    assert ids.age("a", 2.0) is None
    off = ReclaimedIds(limit=0, ttl=3600.0)
    off.add("a", 1.0)
    assert not off.enabled and off.age("a", 2.0) is None


def test_loading_keeps_only_the_young_ones() -> None:
    ids = ReclaimedIds(limit=2, ttl=100.0)
    ids.load([("old", 0.0), ("a", 950.0), ("b", 960.0), ("c", 970.0)], now=1000.0)
    assert ids.entries(1000.0) == [("b", 960.0), ("c", 970.0)]
