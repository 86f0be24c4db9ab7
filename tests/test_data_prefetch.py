"""Read-ahead of training batches (seektrain/data/prefetch.py): the same batches in the same order as the
plain loader, a position that counts the batches handed out (not those read ahead), errors of the
thread raised unchanged in the caller, pinning in the thread, and a thread that always stops."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from seektrain.data import prefetch
from seektrain.data.batch import Batch
from seektrain.data.prefetch import PrefetchingLoader
from seektrain.platform import policy_for
from test_data_loader import arange_dir, rank_loaders  # noqa: F401 (fixture)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "seektrain-prefetch"]


def same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_same_batches_and_a_position_of_consumed_batches(arange_dir, depth):  # noqa: F811
    """Over two epochs (6 batches each): identical batches; after k batches the state equals the plain
    loader's after k, although the thread has read further; that state resumes with batch k + 1."""
    [plain] = rank_loaders(arange_dir, 1, 8)
    [inner] = rank_loaders(arange_dir, 1, 8)
    ahead = PrefetchingLoader(inner, depth)
    try:
        for k in range(1, 15):
            assert same(next(ahead), next(plain)), k
            if k in (3, 6, 7):
                time.sleep(0.3)  # let the thread fill its queue
                assert ahead.state_dict() == plain.state_dict(), k
                if depth:  # the thread holds `depth` batches in the queue and one more in hand
                    ahead_by = inner.state_dict()["consumed_windows"] - plain.state_dict()["consumed_windows"]
                    assert ahead_by == 8 * (depth + 1)
        [fresh] = rank_loaders(arange_dir, 1, 8)
        resumed = PrefetchingLoader(fresh, depth)
        resumed.load_state_dict(ahead.state_dict())
        assert same(next(resumed), next(plain))
        resumed.close()
    finally:
        ahead.close()
    assert prefetch_threads() == []


def test_an_error_in_the_thread_is_raised_unchanged_at_its_batch(arange_dir, monkeypatch):  # noqa: F811
    """The loader fails on its 3rd batch: batches 1 and 2 still arrive, then the caller gets the very
    exception (type and one-line message) that the plain loader raises, and again on the next call."""
    [loader] = rank_loaders(arange_dir, 1, 2)
    calls = itertools.count(1)
    read = loader.dataset.read

    def failing_read(start, length):
        if next(calls) == 5:  # the first window of batch 3
            raise ValueError(
                f"{arange_dir}/shard-00001.bin: sha256 mismatch, the shard is corrupt or modified; "
                "re-run `seektrain data prepare ... --force`"
            )
        return read(start, length)

    monkeypatch.setattr(loader.dataset, "read", failing_read)
    ahead = PrefetchingLoader(loader, 2)
    try:
        next(ahead), next(ahead)
        with pytest.raises(ValueError) as err:
            next(ahead)
        assert str(err.value).startswith(f"{arange_dir}/shard-00001.bin: sha256 mismatch")
        assert "\n" not in str(err.value)
        with pytest.raises(ValueError) as again:
            next(ahead)
        assert again.value is err.value
    finally:
        ahead.close()
    assert prefetch_threads() == []


def test_close_stops_a_thread_blocked_on_a_full_queue(arange_dir):  # noqa: F811
    [loader] = rank_loaders(arange_dir, 1, 2)
    ahead = PrefetchingLoader(loader, 2)
    next(ahead)
    time.sleep(0.3)  # the thread now waits to put its third batch
    assert len(prefetch_threads()) == 1
    ahead.close()
    assert prefetch_threads() == []
    ahead.close()  # idempotent
    with pytest.raises(RuntimeError, match="load the data position before"):
        ahead.load_state_dict(loader.state_dict())


def test_pinning_runs_in_the_thread_on_the_device_asked_for(arange_dir, monkeypatch):  # noqa: F811
    """Without a GPU: the pinning path is taken with fake pin/device functions, which record where they
    ran. With a device the thread makes it current once and pins every batch; without one it does neither."""
    seen = {"device": [], "pinned": []}
    monkeypatch.setattr(
        prefetch, "use_device", lambda d: seen["device"].append((d, threading.current_thread().name))
    )

    def fake_pin(batch):
        seen["pinned"].append(threading.current_thread().name)
        return Batch(batch.tokens.clone(), batch.labels.clone())

    monkeypatch.setattr(prefetch, "pin", fake_pin)
    [plain] = rank_loaders(arange_dir, 1, 2)
    [loader] = rank_loaders(arange_dir, 1, 2)
    ahead = PrefetchingLoader(loader, 2, pin_device=torch.device("cuda", 3))
    try:
        for _ in range(4):
            assert same(next(ahead), next(plain))
    finally:
        ahead.close()
    assert seen["device"] == [(torch.device("cuda", 3), "seektrain-prefetch")]
    assert len(seen["pinned"]) >= 4 and set(seen["pinned"]) == {"seektrain-prefetch"}
    seen["pinned"].clear()
    for pin_device in (None, torch.device("cuda", 3)):  # no pinning without a device, nor without read-ahead
        depth = 2 if pin_device is None else 0
        quiet = PrefetchingLoader(rank_loaders(arange_dir, 1, 2)[0], depth, pin_device=pin_device)
        next(quiet), next(quiet)
        quiet.close()
    assert seen["pinned"] == []


def test_pinning_is_asked_for_only_off_the_cpu():
    assert policy_for("cpu").pin_host_memory() is False
    assert policy_for("cuda").pin_host_memory() is torch.accelerator.is_available()


def test_prefetch_key_bounds():
    from seektrain.config.loader import ConfigError, load_config

    assert load_config(None, []).data.prefetch == 2
    assert load_config(None, ["data.prefetch=0"]).data.prefetch == 0
    for bad in ("data.prefetch=-1", "data.prefetch=65"):
        with pytest.raises(ConfigError, match="data.prefetch"):
            load_config(None, [bad])
