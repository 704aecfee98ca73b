"""PollingStore (live mode's rendezvous store): waits poll the inner store, reads and writes
pass through, a wait past its timeout names its keys, and gloo builds groups through it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hexagram.elastic.polling_store import PollingStore
from hexagram.launch import free_port


@pytest.fixture()
def tcp_store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def test_a_get_waits_for_a_key_set_later_by_another_client(tcp_store: dist.Store) -> None:
    store = PollingStore(dist.PrefixStore("p/", tcp_store), timeout=5.0)
    threading.Timer(0.1, lambda: dist.PrefixStore("p/", tcp_store).set("k", "v")).start()
    started = time.monotonic()
    assert store.get("k") == b"v"
    assert 0.05 < time.monotonic() - started < 2.0
    assert store.add("n", 2) == 2 and store.check(["k", "n"]) and not store.check(["x"])
    assert store.compare_set("k", "v", "w") == b"w"
    assert store.num_keys() >= 2 and store.delete_key("n")


def test_a_wait_past_its_timeout_names_the_keys(tcp_store: dist.Store) -> None:
    store = PollingStore(tcp_store, timeout=0.2)
    with pytest.raises(dist.DistStoreError, match="never"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="also-never"):
        store.wait(["also-never"], timedelta(seconds=0.1))


def test_gloo_builds_and_uses_groups_through_it(tcp_store: dist.Store) -> None:
    store = PollingStore(dist.PrefixStore("e1/pg/", tcp_store), timeout=10.0)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    try:
        group = dist.new_group([0])
        x = torch.ones(3)
        dist.all_reduce(x)
        dist.all_reduce(x, group=group)
        assert torch.equal(x, torch.ones(3))
    finally:
        dist.destroy_process_group()


def test_a_clone_polls_too_and_shares_the_keys(tcp_store: dist.Store) -> None:
    store = PollingStore(dist.PrefixStore("c/", tcp_store), timeout=0.2)
    twin = store.clone()
    assert isinstance(twin, PollingStore)
    store.multi_set(["a", "b"], ["1", "2"])
    assert twin.multi_get(["a", "b"]) == [b"1", b"2"]
    with pytest.raises(dist.DistStoreError, match="missing"):
        twin.multi_get(["a", "missing"])
