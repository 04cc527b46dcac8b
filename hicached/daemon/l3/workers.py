"""L3 I/O worker threads: the control loop never waits on a store.

Three threads: one per direction, so a load someone is waiting for is never stuck behind a
backlog of write-throughs, and one for existence checks (``exists`` / ``find`` jobs: which keys
does the store have?), so an exists is never stuck behind a 64 MiB load. A put job first asks
the backend which of its pages it has already (a store round trip, here and not on the loop) and
sends only the others (``IOJob.already``). Each has a bounded queue: ``submit`` returns False
when it is full (the controller then skips the write-through, or answers the load or lookup as a
miss) instead of blocking the loop. Finished jobs go to one completion queue, and a byte on a
pipe wakes the loop's poller.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class IOJob:
    """One batched backend call. ``result`` (one bool per key) is filled by the worker."""

    kind: str  # "put" | "get" | "clear" | "exists" | "find" (exists, then the tier loads) |
    # "audit" (exists of pages known stored: audit.py)
    ns: str
    pool: str
    keys: list[str]
    offsets: list[int]
    page_bytes: int
    entries: list[Any]
    result: list[bool] = field(default_factory=list)
    waiters: list[Any] = field(default_factory=list)  # parked requests (owned by the controller)
    backend: Any = None  # the L3Backend the job was queued for (attach/detach may swap it)
    done: Any = None  # "clear": called on the control loop with the count or the exception
    already: set[int] = field(default_factory=set)  # put: positions L3 had (not sent)
    stride: int = 0  # find: slot stride of the loads that follow
    error: str = ""  # exists / find: why the store could not answer (the result is all False)


# the queue (and thread) of each job kind
QUEUE_OF = {"put": "put", "clear": "put", "get": "get", "exists": "probe", "find": "probe",
            "audit": "probe"}


class IOWorkers:
    """A writer, a reader and a prober thread calling ``job.backend.batch_put`` / ``batch_get``
    / ``exists``."""

    def __init__(self, queue_depth: int = 256, get_threads: int = 1):
        self.done: queue.SimpleQueue[IOJob] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self._queues = {q: queue.Queue(queue_depth) for q in ("put", "get", "probe")}
        self._threads = [
            (kind, threading.Thread(target=self._run, args=(kind,),
                                    name=f"hicached-l3-{kind}{i}", daemon=True))
            for kind, n in (("put", 1), ("get", get_threads), ("probe", 1)) for i in range(n)
        ]
        self.in_flight = 0  # submitted and not yet collected (control loop only)
        self.bytes_done = {"put": 0, "get": 0}  # page bytes moved by successful jobs (metrics)
        for _, t in self._threads:
            t.start()

    def submit(self, job: IOJob) -> bool:
        """Queue a job; False if its queue is full."""
        try:  # a clear goes behind the writes queued before it
            self._queues[QUEUE_OF[job.kind]].put_nowait(job)
        except queue.Full:
            return False
        self.in_flight += 1
        return True

    def _run(self, kind: str) -> None:
        q = self._queues[kind]
        while True:
            job = q.get()
            if job is None:
                return
            backend = job.backend
            if job.kind == "clear":  # (ns: one namespace's pages, ``L3Tier.clear``)
                try:
                    job.result = [backend.clear_namespace(job.ns) if job.ns else backend.clear()]
                except Exception as e:  # noqa: BLE001 - handed to the job's caller
                    job.result = [e]
                self._finished(job)
                continue
            if kind == "probe":
                self._probe(job)
                self._finished(job)
                continue
            try:
                if kind == "put":
                    job.result = self._put_missing(job)
                else:
                    job.result = _checked(backend.batch_get(job.ns, job.pool, job.keys,
                                                            job.offsets, job.page_bytes),
                                          len(job.keys), "batch_get")
            except Exception:
                log.exception("L3 %s of %d pages failed; treated as misses", kind, len(job.keys))
                job.result = [False] * len(job.keys)
            self._finished(job)

    @staticmethod
    def _probe(job: IOJob) -> None:
        """Which keys of ``job`` the store has; a failing store has none (``job.error``)."""
        try:
            job.result = [bool(h) for h in _checked(job.backend.exists(job.ns, job.pool, job.keys),
                                                    len(job.keys), "exists")]
        except Exception as e:  # noqa: BLE001 - a failing L3 is a miss; the tier logs it
            job.error = f"{type(e).__name__}: {e}"
            job.result = [False] * len(job.keys)

    @staticmethod
    def _put_missing(job: IOJob) -> list[bool]:
        """Send the pages of ``job`` the backend lacks; those it has count as stored."""
        backend = job.backend
        try:
            have = _checked(backend.exists(job.ns, job.pool, job.keys), len(job.keys), "exists")
        except Exception as e:  # noqa: BLE001 - unknown: send them all (a put is idempotent)
            log.debug("L3 exists before a put failed (%s); sending every page", e)
            have = [False] * len(job.keys)
        job.already = {i for i, h in enumerate(have) if h}
        todo = [i for i in range(len(job.keys)) if i not in job.already]
        result = [True] * len(job.keys)
        if todo:
            sent = _checked(backend.batch_put(job.ns, job.pool, [job.keys[i] for i in todo],
                                              [job.offsets[i] for i in todo], job.page_bytes),
                            len(todo), "batch_put")
            for i, ok in zip(todo, sent):
                result[i] = bool(ok)
        return result

    def _finished(self, job: IOJob) -> None:
        self.done.put(job)
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def collect(self) -> list[IOJob]:
        """Finished jobs (control loop)."""
        try:
            os.read(self.wake_r, 65536)
        except BlockingIOError:
            pass
        jobs = []
        while True:
            try:
                jobs.append(self.done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(jobs)
        for job in jobs:
            if job.kind in self.bytes_done:
                moved = sum(map(bool, job.result)) - len(job.already)
                self.bytes_done[job.kind] += job.page_bytes * moved
        return jobs

    def close(self, timeout_s: float = 10.0) -> bool:
        """Let queued jobs finish (up to ``timeout_s``), stop the threads; True if they ended."""
        for kind, _ in self._threads:
            try:
                self._queues[kind].put(None, timeout=timeout_s)
            except queue.Full:
                log.warning("L3 %s queue still full at shutdown", kind)
        for _, t in self._threads:
            t.join(timeout_s)
        ended = not any(t.is_alive() for _, t in self._threads)
        os.close(self.wake_r)
        os.close(self.wake_w)
        return ended


def _checked(result, n: int, what: str) -> list[bool]:
    """A backend's per-key answer for ``n`` keys, as a list (RuntimeError if not ``n`` long)."""
    out = list(result)
    if len(out) != n:
        raise RuntimeError(f"{what} answered {len(out)} results for {n} keys")
    return out
