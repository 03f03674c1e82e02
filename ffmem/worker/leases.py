"""How a worker keeps what it holds, and how others tell that it died.

- `Heartbeat`: while a step runs (preparing a run, mining a shard, finishing a run, an analysis), a
  thread renews the step's lease every third of the lease, so a step may take longer than the lease
  (a large model loading, a large corpus tokenized) and keep its job; when the worker dies the beats
  stop and the lease runs out. Before the step commits what it did, `check` renews the lease in the
  step's own transaction and raises `LostLease` when another worker took the work over.
- `Presence`: each worker process holds an exclusive lock (flock) on a file named by its random id
  for as long as it lives; the kernel drops the lock when the process dies, however it dies. A worker
  starting finds a holder's file unlocked: that holder is dead, and its leases end at once (rerunning a
  killed `ffmem index` resumes without waiting the lease out); then dead workers' files go. No file:
  the holder runs elsewhere (on another machine, in another container) and its lease decides. Host
  names and PIDs, which containers share, are never used to judge.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from sqlalchemy.orm import Session, sessionmaker

from ffmem.engine.errors import FfmemError

try:
    import fcntl
except ImportError:  # Windows: no presence files; leases alone decide
    fcntl = None

log = logging.getLogger("ffmem")
WORKER_ID = re.compile(r"[0-9a-f]{32}$")  # the uuid4 at the end of jobs.worker_id()


class LostLease(FfmemError):
    """Another worker took over this shard or job (our lease ran out)."""


class Heartbeat:
    """The lease on `what` ("job 3", "shard 0 of run 2"), kept while a step runs: `renew(session)` (True:
    the lease is still ours) is called every `every` seconds from a daemon thread, each time in a
    transaction of its own, until the `with` block ends. A renewal that fails (a busy database) is
    tried again at the next beat; one that finds the lease lost sets `lost` and stops."""

    def __init__(
        self, renew: Callable[[Session], bool], sessions: sessionmaker, every: float, what: str
    ) -> None:
        self.renew, self.sessions, self.every, self.what = renew, sessions, every, what
        self.lost = threading.Event()
        self.beats = 0  # renewals that held
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease of {what}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=60)  # a renewal waiting on the step's own row lock ends with the step

    def check(self, session: Session) -> None:
        """Renew the lease in `session`, the step's transaction, before the step commits: the renewal's
        row lock keeps the lease ours until that commit. Raises LostLease when it was taken over."""
        if self.lost.is_set() or not self.renew(session):
            self.lost.set()
            raise LostLease(f"{self.what} was taken over")

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with self.sessions() as session:
                    held = self.renew(session)
                    session.commit()
            except Exception as error:  # noqa: BLE001 - e.g. SQLite locked by the step's own write
                log.debug("lease renewal failed (%s); trying again in %g s", error, self.every)
                continue
            if not held:
                self.lost.set()
                return
            self.beats += 1


class Presence:
    """This process's presence file in `folder` (a lock held while it lives), and the question whether
    another worker's process is dead."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or Path(tempfile.gettempdir()) / f"ffmem-workers-{_uid()}"
        self._held: dict[str, int] = {}  # worker id → the descriptor holding its lock

    def announce(self, worker: str) -> None:
        """Hold `worker`'s lock until `withdraw` (or this process's end)."""
        path = self._path(worker)
        if path is None or worker in self._held:
            return
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:  # an unwritable temp folder: others wait for our leases to run out
            log.debug("no presence file for %s (%s)", worker, error)
            return
        self._held[worker] = descriptor

    def sweep(self) -> None:
        """Drop the files of dead workers (call it once their leases are ended: a file is the proof)."""
        for path in self.folder.glob("*.lock"):
            self.is_dead(path.stem)

    def withdraw(self, worker: str) -> None:
        """`worker` stops: drop its file and lock."""
        descriptor = self._held.pop(worker, None)
        if descriptor is None:
            return
        self._path(worker).unlink(missing_ok=True)
        os.close(descriptor)  # closing drops the lock

    def is_dead(self, worker: str) -> bool:
        """Whether `worker` surely died: its presence file is here and nobody holds its lock. False when
        unknown (no file: it runs on another machine or in another container, or is not ours)."""
        path = self._path(worker)
        if path is None or worker in self._held:
            return False
        try:
            descriptor = os.open(path, os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: it lives
            os.close(descriptor)
            return False
        path.unlink(missing_ok=True)  # dead: its file goes
        os.close(descriptor)
        return True

    def _path(self, worker: str) -> Path | None:
        """The file of `worker`, named by its uuid; None for an id that is not ours or without flock."""
        found = WORKER_ID.search(worker)
        return None if found is None or fcntl is None else self.folder / f"{found.group()}.lock"


def _uid() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else "user"


def checked_commit(session: Session, lease: Heartbeat | None) -> None:
    """Commit `session`, after checking `lease` (when the work holds one): a worker that lost it stops
    before it commits."""
    if lease is not None:
        lease.check(session)
    session.commit()
