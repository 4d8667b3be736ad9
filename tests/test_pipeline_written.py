"""The pipeline's "written meanwhile" rule: which file, never a comparison of times.

A small in-process driver stands in for pocl here: what is tested is the pipeline's own
bookkeeping (claims, the store's stamps), not a driver's behaviour. The store is real.
"""

from __future__ import annotations

import hashlib

from asyncclcache.drivers import Driver, Job, Purpose, Snapshot
from asyncclcache.keys import KeyInfo
from asyncclcache.pipeline import Pipeline
from asyncclcache.stats import Counters
from asyncclcache.store import Store
from asyncclcache.workers import Workers

DEVICE = {"platform_name": "p", "platform_vendor": "v", "platform_version": "1", "device_name": "d",
          "device_vendor": "v", "device_version": "1", "driver_version": "1"}


class _Inline(Driver):
    name = "inline-test"

    def fetch(self, job, purpose, done):
        done(Snapshot([b"binary of " + job.source]), None)


def _job(store: Store, key: str, seen) -> Job:
    info = KeyInfo(key, (DEVICE,), b"", hashlib.sha256(b"src").hexdigest(), ())
    return Job(info, b"src", [], [], _Inline(), seen=seen)


def _pipeline(store: Store) -> tuple[Pipeline, Counters, Workers]:
    counters = Counters()
    workers = Workers(1, "test-writer", lambda e: None)
    return Pipeline(store, workers, counters, max_size=None, on_written=lambda e: None), counters, workers


def test_a_second_miss_of_a_key_this_process_wrote_meanwhile_is_skipped(tmp_path):
    # Both lookups saw no file; the first job's write lands before the second claims.
    store = Store(tmp_path / "acc", rank_local=False)
    pipeline, counters, workers = _pipeline(store)
    key = hashlib.sha256(b"k").hexdigest()
    first = _job(store, key, None)
    assert pipeline.add(first)
    pipeline.fetch(first, Purpose.SNAPSHOT_NOW)
    assert pipeline.wait(30)
    # Lookups that saw no file, or (a memory hit then unused) the very file this process
    # wrote: neither writes it a second time.
    for seen in (None, store.stamp(key)):
        again = _job(store, key, seen)
        assert pipeline.add(again)
        pipeline.fetch(again, Purpose.SNAPSHOT_NOW)
        assert pipeline.wait(30)
    s = counters.snapshot()
    assert (s.writes, s.skipped) == (1, 2)
    pipeline.close()
    workers.stop(1.0)


def test_a_file_other_than_the_one_the_lookup_saw_is_someone_elses(tmp_path):
    store = Store(tmp_path / "acc", rank_local=False)
    key = hashlib.sha256(b"k2").hexdigest()
    # Another process wrote the key: this process saw its file at the lookup, then it was
    # replaced (a new inode), so the miss is skipped; seeing that very file, it writes.
    other, _other_counters, other_workers = _pipeline(store)
    job = _job(store, key, None)
    assert other.add(job)
    other.fetch(job, Purpose.SNAPSHOT_NOW)
    assert other.wait(30)
    seen = store.stamp(key)
    assert seen is not None
    mine, counters, workers = _pipeline(store)
    replace = _job(store, key, seen)  # e.g. a hit that the driver did not use
    assert mine.add(replace)
    mine.fetch(replace, Purpose.SNAPSHOT_NOW)
    assert mine.wait(30)
    assert (counters.snapshot().writes, counters.snapshot().skipped) == (1, 0)
    stale = _job(store, key, seen)  # the file it saw has been replaced since
    assert mine.add(stale)
    mine.fetch(stale, Purpose.SNAPSHOT_NOW)
    assert mine.wait(30)
    assert (counters.snapshot().writes, counters.snapshot().skipped) == (1, 1)
    for p, w in ((other, other_workers), (mine, workers)):
        p.close()
        w.stop(1.0)


def test_a_claim_unless_written_since_is_given_back_for_any_other_file(tmp_path):
    store = Store(tmp_path / "acc", rank_local=False)
    key = "c" * 64
    # No file, and the lookup saw none: the key is this process's to write.
    claim = store.claim(key, unless_written_since=(None, None))
    assert claim is not None
    pipeline, _, workers = _pipeline(store)
    try:
        job = _job(store, key, None)
        assert pipeline.add(job)
        claim.release()
        pipeline.fetch(job, Purpose.SNAPSHOT)
        assert pipeline.wait(30)
    finally:
        workers.stop(5.0)
    written = store.stamp(key)
    assert written is not None
    # A file the lookup did not see: someone else's write; the lock is given back.
    assert store.claim(key, unless_written_since=(None, None)) is None
    # The very file the lookup saw: still the caller's to replace...
    again = store.claim(key, unless_written_since=(written, None))
    assert again is not None
    again.release()
    # ...unless it is the caller's own last write.
    assert store.claim(key, unless_written_since=(written, written)) is None
    # Given back every time: a plain claim still gets the key.
    last = store.claim(key)
    assert last is not None
    last.release()
