"""The one process cache (ffmem.store.cache): bounded and safe under threads, FIFO or LRU, and a value
that may still change (`final=False`) is never kept."""

from __future__ import annotations

import threading

import pytest

from ffmem.store.cache import ProcessCache


@pytest.mark.parametrize("lru", [False, True])
def test_many_threads_never_raise_nor_overfill(lru):
    cache = ProcessCache(16, lru=lru)
    errors: list[BaseException] = []
    sizes: list[int] = []
    start = threading.Barrier(8)

    def work(seed: int) -> None:
        try:
            start.wait()
            for i in range(2_000):
                key = (seed * 7 + i) % 40  # overlapping keys across the threads
                if cache.get(key) is None:
                    cache.put(key, key * 10, final=i % 5 != 0)
                else:
                    assert cache.get(key) in (None, key * 10)
                sizes.append(len(cache))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert max(sizes) <= 16
    assert len(cache) <= 16
    assert all(cache.get(key) == key * 10 for key in cache.keys())


def test_fifo_evicts_the_oldest_stored_and_reads_do_not_refresh():
    cache = ProcessCache(3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a read: "a" stays the oldest
    cache.put("d", "D")
    assert cache.keys() == ["b", "c", "d"]
    assert cache.get("a") is None
    assert cache.get("a", "missing") == "missing"
    cache.put("c", "C2")  # a key already kept: new value, same place, nothing evicted
    assert cache.keys() == ["b", "c", "d"]
    assert cache.get("c") == "C2"
    cache.put("e", "E")
    assert cache.keys() == ["c", "d", "e"]


def test_lru_evicts_the_least_recently_used():
    cache = ProcessCache(3, lru=True)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a read makes "a" the newest
    cache.put("d", "D")
    assert cache.keys() == ["c", "a", "d"]
    cache.put("c", "C2")  # a put of a kept key makes it the newest
    assert cache.keys() == ["a", "d", "c"]
    cache.put("e", "E")
    assert cache.keys() == ["d", "c", "e"]


def test_a_value_not_final_is_neither_kept_nor_evicts():
    for lru in (False, True):
        cache = ProcessCache(2, lru=lru)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.put("c", 3, final=False)
        assert cache.keys() == ["a", "b"]
        assert cache.get("c") is None
        cache.put("a", 10, final=False)  # nor does it replace a kept value
        assert cache.get("a") == 1


def test_none_is_a_value_to_keep():
    cache = ProcessCache(1)
    cache.put("run", None)
    assert cache.get("run", "missing") is None
    cache.put("other", 1)
    assert cache.get("run", "missing") == "missing"


def test_nothing_kept_at_size_zero():
    cache = ProcessCache(0, lru=True)
    cache.put("a", 1)
    assert len(cache) == 0
