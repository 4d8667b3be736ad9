"""The pipeline alone: claims, publish, refresh, drop, errors and close, with a small fake
driver and a real store in a temporary directory (issue 20). What a real driver retrieves
is tested elsewhere, on real pocl and rusticl; here only the pipeline's own bookkeeping.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from asyncclcache.drivers import Driver, Dropped, Hit, HitOutcome, Job, Lost, Purpose, Snapshot
from asyncclcache.keys import KeyInfo
from asyncclcache.pipeline import Pipeline
from asyncclcache.stats import Counters
from asyncclcache.store import Store
from asyncclcache.workers import Workers

DEVICE = {"platform_name": "p", "platform_vendor": "v", "platform_version": "1", "device_name": "d",
          "device_vendor": "v", "device_version": "1", "driver_version": "1"}


class Fake(Driver):
    """Answers each fetch from ``answers`` (a Snapshot, or an exception to report), on a
    thread of its own, as the real drivers do; ``gate`` holds the answers back."""

    name = "fake"
    refreshable = True

    def __init__(self, *answers: Snapshot | BaseException) -> None:
        self.answers = list(answers)
        if any(isinstance(a, Snapshot) and a.files is not None for a in answers):
            self.kind = "kcache"  # files of a driver's cache, as pocl's folder holds them
        self.gate = threading.Event()
        self.gate.set()
        self.fetched: list[Purpose] = []
        self.stale_jobs: list[Job] = []
        self.wrote: list[list[str] | None] = []  # what written() was told, in order
        self.told: list[tuple[str, Job]] = []  # the per-job hooks called: built, watch

    def built(self, job: Job) -> None:
        self.told.append(("built", job))

    def watch(self, job: Job, entry, hit) -> None:
        self.told.append(("watch", job))

    def fetch(self, job: Job, purpose: Purpose, done) -> None:
        self.fetched.append(purpose)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

        def reply() -> None:
            self.gate.wait(30)
            if isinstance(answer, BaseException):
                done(None, answer)
            else:
                done(answer, None)

        threading.Thread(target=reply, daemon=True).start()

    def stale(self, jobs: Sequence[Job]) -> list[Job]:
        self.stale_jobs = list(jobs)
        return list(jobs)

    def written(self, job: Job, snap: Snapshot) -> None:
        self.wrote.append(snap.files)


def _job(driver: Driver, key: str = "a" * 64) -> Job:
    info = KeyInfo(key, (DEVICE,), b"-DX=1", hashlib.sha256(b"src").hexdigest(), ())
    return Job(info, b"src", [], ["log"], driver, kernels=("k",), built_to=1.0)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "acc", rank_local=False)


@pytest.fixture
def make(store: Store) -> Iterator:
    made: list[tuple[Pipeline, Workers]] = []

    def make_pipeline(on_store: Store | None = None) -> tuple[Pipeline, Counters]:
        counters = Counters()
        workers = Workers(1, "test-writer", lambda e: None)
        p = Pipeline(on_store or store, workers, counters, max_size=None, on_written=lambda e: None)
        made.append((p, workers))
        return p, counters

    yield make_pipeline
    for p, workers in made:
        p.close()
        workers.stop(5.0)


def _until_fetched(driver: Fake) -> None:
    """Until the pipeline has claimed the key and asked ``driver`` (a writer thread does)."""
    for _ in range(300):
        if driver.fetched:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the pipeline never asked its driver")


def _run(pipeline: Pipeline, job: Job, purpose: Purpose = Purpose.SNAPSHOT_NOW) -> None:
    assert pipeline.add(job)
    pipeline.fetch(job, purpose)
    assert pipeline.wait(30)


def test_a_snapshot_is_published_whole_and_the_claim_released(store: Store, make) -> None:
    pipeline, counters = make()
    driver = Fake(Snapshot([b"one", b"two"], files=["AB/CDEFGHIJKL/program.bc", "AB/CDEFGHIJKL/k/4-1-1/k.so"]))
    job = _job(driver)
    _run(pipeline, job)
    s = counters.snapshot()
    assert (s.writes, s.skipped, s.errors, s.pending) == (1, 0, 0, 0)
    entry = store.load(job.key)
    assert entry is not None and entry.binaries == (b"one", b"two")
    assert entry.meta.files == ["AB/CDEFGHIJKL/program.bc", "AB/CDEFGHIJKL/k/4-1-1/k.so"] and entry.meta.kernels == ["k"]
    assert not pipeline.holds_claim(job) and driver.wrote == [["AB/CDEFGHIJKL/program.bc", "AB/CDEFGHIJKL/k/4-1-1/k.so"]]
    claim = store.claim(job.key)  # released: another writer may take it now
    assert claim is not None
    claim.release()


def test_a_key_another_process_holds_is_skipped(store: Store, make) -> None:
    pipeline, counters = make()
    driver = Fake(Snapshot([b"b"]))
    held = store.claim("b" * 64)  # another process (rank) works on the key
    assert held is not None
    try:
        _run(pipeline, _job(driver, "b" * 64))
    finally:
        held.release()
    s = counters.snapshot()
    assert (s.writes, s.skipped) == (0, 1) and driver.fetched == []
    assert store.load("b" * 64) is None


def test_two_claimants_one_writes(tmp_path: Path, make) -> None:
    # Two caches (two processes' pipelines) on one directory, the same key at once: the
    # first claim wins, the other skips without asking its driver.
    first, second = Store(tmp_path / "shared", rank_local=False), Store(tmp_path / "shared", rank_local=False)
    p1, c1 = make(first)
    p2, c2 = make(second)
    slow = Fake(Snapshot([b"from one"]))
    slow.gate.clear()  # holds the claim while "retrieving"
    fast = Fake(Snapshot([b"from two"]))
    j1, j2 = _job(slow, "c" * 64), _job(fast, "c" * 64)
    assert p1.add(j1)
    p1.fetch(j1, Purpose.SNAPSHOT_NOW)
    _until_fetched(slow)
    _run(p2, j2)
    slow.gate.set()
    assert p1.wait(30)
    assert (c1.snapshot().writes, c2.snapshot().writes, c2.snapshot().skipped) == (1, 0, 1)
    assert fast.fetched == []
    entry = first.load("c" * 64)
    assert entry is not None and entry.binaries == (b"from one",)


@pytest.mark.parametrize(("error", "counter"), [
    (RuntimeError("driver broke"), "errors"),
    (Lost("no folder of this build"), "unidentified"),
    (Dropped("closed"), "skipped"),
])
def test_a_failed_fetch_writes_nothing_and_releases_the_claim(store: Store, make, error, counter) -> None:
    pipeline, counters = make()
    job = _job(Fake(error))
    _run(pipeline, job)
    s = counters.snapshot()
    assert s.writes == 0 and getattr(s, counter) == 1, s
    assert store.load(job.key) is None and not pipeline.holds_claim(job)
    errors = pipeline.take_errors()
    assert (errors == [error]) == (counter == "errors")


def test_the_pipeline_alone_tells_the_driver_of_a_miss_and_of_a_watched_hit(store: Store, make) -> None:
    # The cache hands a miss over (add) and a hit it keeps (watch); the driver hears of each
    # once, from the pipeline, and of a miss already on its way not at all.
    pipeline, _ = make()
    driver = Fake(Snapshot([b"x"]))
    driver.gate.clear()
    miss = _job(driver)
    assert pipeline.add(miss) and driver.told == [("built", miss)]
    pipeline.fetch(miss, Purpose.SNAPSHOT_NOW)
    assert not pipeline.add(_job(driver)) and driver.told == [("built", miss)]
    driver.gate.set()
    assert pipeline.wait(30)
    entry = store.load(miss.key)
    hit = _job(driver, "e" * 64)
    pipeline.used(entry, Hit(HitOutcome.USED), hit)
    assert driver.told == [("built", miss)]  # this driver watches no hits: not kept either
    assert pipeline.job(hit.key) is None
    driver.watches_hits = True
    pipeline.used(entry, Hit(HitOutcome.USED), hit)
    assert driver.told == [("built", miss), ("watch", hit)] and pipeline.job(hit.key) is hit


def test_a_refresh_rewrites_only_what_changed(store: Store, make) -> None:
    pipeline, counters = make()
    driver = Fake(Snapshot([b"v1"], files=["AB/CDEFGHIJKL/program.bc"]), Snapshot([b"v1"], files=["AB/CDEFGHIJKL/program.bc"]),
                  Snapshot([b"v1", b"v2"], files=["AB/CDEFGHIJKL/program.bc", "AB/CDEFGHIJKL/k/4-1-1/k.so"]))
    job = _job(driver)
    _run(pipeline, job)
    first = store.stamp(job.key)
    pipeline.refresh()  # the same content: nothing written
    assert pipeline.wait(30)
    assert driver.stale_jobs == [job]
    assert counters.snapshot().refreshes == 0 and store.stamp(job.key) == first
    pipeline.refresh()  # a variant more: rewritten
    assert pipeline.wait(30)
    s = counters.snapshot()
    assert (s.writes, s.refreshes) == (2, 1) and store.stamp(job.key) != first
    entry = store.load(job.key)
    assert entry is not None and entry.meta.snapshot == "refresh"
    assert entry.meta.files == ["AB/CDEFGHIJKL/program.bc", "AB/CDEFGHIJKL/k/4-1-1/k.so"]


def _held(pipeline: Pipeline, answer: Snapshot) -> tuple[Fake, Job]:
    """A job on its way: claimed, its driver asked, the answer held back (``gate``)."""
    driver = Fake(answer)
    driver.gate.clear()
    job = _job(driver)
    assert pipeline.add(job)
    pipeline.fetch(job, Purpose.SNAPSHOT_NOW)
    _until_fetched(driver)
    return driver, job


def test_a_second_miss_while_the_first_is_on_its_way_is_not_added(store: Store, make) -> None:
    pipeline, counters = make()
    driver, _ = _held(pipeline, Snapshot([b"x"]))
    assert not pipeline.add(_job(driver))
    driver.gate.set()
    assert pipeline.wait(30)
    assert counters.snapshot().writes == 1


def test_close_drops_what_is_on_its_way(store: Store, make) -> None:
    pipeline, counters = make()
    driver, job = _held(pipeline, Snapshot([b"late"]))
    pipeline.close()
    driver.gate.set()
    assert pipeline.wait(30)
    s = counters.snapshot()
    assert (s.writes, s.skipped, s.pending) == (0, 1, 0)
    assert store.load(job.key) is None and not pipeline.holds_claim(job)
    pipeline.fetch(_job(driver, "d" * 64), Purpose.SNAPSHOT_NOW)  # after close: nothing
    assert pipeline.pending == 0 and driver.fetched == [Purpose.SNAPSHOT_NOW]


def test_a_driver_that_raises_in_fetch_ends_the_job_as_a_failure(store: Store, make) -> None:
    class Raising(Fake):
        def fetch(self, job: Job, purpose: Purpose, done) -> None:
            raise RuntimeError("driver bug")

    pipeline, counters = make()
    job = _job(Raising(Snapshot([b"x"])))
    _run(pipeline, job)  # ends: nothing stays pending
    s = counters.snapshot()
    assert (s.errors, s.writes, s.pending) == (1, 0, 0)
    assert not pipeline.holds_claim(job) and store.load(job.key) is None
    assert [str(e) for e in pipeline.take_errors()] == ["driver bug"]


def test_a_handoff_runs_once_on_a_worker_or_on_the_caller_that_cannot_wait_for_one():
    import threading

    from asyncclcache.workers import Handoff

    workers = Workers(1, "test-handoff", lambda e: None)
    release = threading.Event()
    try:
        # The only worker is busy: the caller runs the task itself, at once.
        workers.submit(release.wait)
        ran_on: list[str] = []
        task = workers.handoff(lambda: ran_on.append(threading.current_thread().name) or 7)
        assert task.result() == 7 and ran_on == [threading.current_thread().name]
        release.set()
        # Free again: a worker takes it, the caller waits for its value; once in all.
        started, go = threading.Event(), threading.Event()

        def slow() -> str:
            started.set()
            go.wait(10)
            ran_on.append(threading.current_thread().name)
            return "done"

        task = workers.handoff(slow)
        assert started.wait(10)
        threading.Timer(0.05, go.set).start()
        assert task.result() == "done" and task.result() == "done"
        assert ran_on[1:] == ["test-handoff-0"]
    finally:
        release.set()
        workers.stop(10)
    # An error is the caller's, from result().
    failing = Handoff(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result()


def test_work_queued_at_the_threads_start_all_runs_and_stop_joins_them():
    workers = Workers(2, "test-queued", lambda e: None)
    done: list[int] = []
    for i in range(20):
        workers.submit(done.append, i)
    workers.stop(10)  # at once: still every task, then joined
    assert sorted(done) == list(range(20))
    assert not any(t.is_alive() for t in workers._threads)
