"""Bounded math checks: ``math-verify`` runs in worker processes with a deadline for every sample.

``math-verify`` can run forever on a hostile answer (``\\boxed{10^{10^{10}}}`` against ``1`` evaluates a
ten-billion-digit power, holding the GIL), and neither ``SIGALRM`` (main thread only, and not delivered
inside a long C computation) nor a thread can stop it. :class:`VerifierPool` keeps ``num_workers`` worker
processes (``python -P _verify_worker.py``: the standard library and ``math_verify`` only, no torch),
sends them one sample at a time, and kills and replaces a worker whose sample runs past ``timeout_s``; that
sample gets the status ``timeout``. A worker that dies on a sample (a crash, the memory limit) gives that
sample the status ``crash`` and is replaced. The deadline of a sample starts when a ready worker receives
it, so a replacement's start-up time is never charged to the next sample.

Workers start on the first :meth:`VerifierPool.run` and stop on :meth:`VerifierPool.close`, when the pool
is garbage collected, and at interpreter exit; a worker whose parent is gone exits on its own (end of
file on its task pipe).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

WORKER = Path(__file__).with_name("_verify_worker.py")


@dataclass
class Result:
    """One sample's outcome: ``status`` ``ok``, ``bad_gold``, ``error`` (parse/verify raised), ``timeout``
    or ``crash`` (the worker died); ``score`` is the check's 0/1 for ``ok``, else 0.0; ``detail`` the
    error."""

    status: str
    score: float = 0.0
    detail: str = ""


@dataclass
class _Worker:
    proc: subprocess.Popen
    tasks: Connection
    results: Connection
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    task: int | None = None
    deadline: float = 0.0

    def kill(self) -> None:
        for conn in (self.tasks, self.results):
            with contextlib.suppress(OSError):
                conn.close()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # a kill that did not take: leave it
            self.proc.wait(timeout=10)


def _spawn(memory_mb: int) -> _Worker:
    task_r, task_w = os.pipe()
    result_r, result_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", str(WORKER), str(task_r), str(result_w), str(memory_mb)],
            pass_fds=(task_r, result_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            close_fds=True,
        )
    except BaseException:
        for fd in (task_r, task_w, result_r, result_w):
            os.close(fd)
        raise
    os.close(task_r)
    os.close(result_w)
    return _Worker(proc, Connection(task_w, readable=False), Connection(result_r, writable=False))


def _close_all(workers: list[_Worker], owner: int) -> None:
    if os.getpid() == owner:  # a forked child (a DataLoader worker) leaves its parent's workers alone
        for w in workers:
            w.kill()
    workers.clear()


class VerifierPool:
    """``num_workers`` math-verify worker processes; :meth:`run` checks a batch with a per-sample deadline.

    Args:
        num_workers: worker processes (each holds its own sympy, about 100 MB).
        timeout_s: the most seconds one sample may take; past it its worker is killed and replaced.
        startup_timeout_s: the most seconds a worker may take to start (import math-verify).
        memory_mb: address-space limit of a worker (``RLIMIT_AS``; 0: none); a sample that needs more
            fails in its worker (status ``error`` or ``crash``) instead of exhausting the machine.
    """

    def __init__(
        self,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        startup_timeout_s: float = 120.0,
        memory_mb: int = 4096,
    ):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"VerifierPool: num_workers >= 1 and timeout_s > 0 (got {num_workers}, {timeout_s})"
            )
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.startup_timeout_s, self.memory_mb = startup_timeout_s, memory_mb
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, self._workers, self._owner)

    def close(self) -> None:
        """Stop the workers (a later :meth:`run` starts new ones)."""
        with self._lock:
            _close_all(self._workers, self._owner)

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_spawn(self.memory_mb))

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self._fill()

    def _started(self, worker: _Worker, message) -> None:
        if message[0] == "import_error":
            self._replace(worker)
            raise ImportError(
                f"the math reward needs math-verify: pip install 'alignlit[env]' ({message[1]})"
            )
        worker.ready = True

    def run(self, tasks: list[tuple[str, str]]) -> list[Result]:
        """Check ``(gold, response)`` pairs; one :class:`Result` per pair, in order. Returns within about
        ``len(tasks) / num_workers * timeout_s`` plus the workers' start-up however the samples behave."""
        with self._lock:
            if os.getpid() != self._owner:  # forked: the workers are the parent's; start our own
                _close_all(self._workers, self._owner)
                self._owner = os.getpid()
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close_all, self._workers, self._owner)
            return self._run(tasks)

    def _run(self, tasks: list[tuple[str, str]]) -> list[Result]:
        results: list[Result | None] = [None] * len(tasks)
        pending = list(range(len(tasks)))[::-1]
        self._fill()
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    i = pending.pop()
                    try:
                        w.tasks.send_bytes(json.dumps([i, *tasks[i]]).encode())
                    except OSError:  # the worker died between samples: retry the sample on a new one
                        pending.append(i)
                        self._replace(w)
                        continue
                    w.task, w.deadline = i, now + self.timeout_s
            deadlines = [w.deadline for w in self._workers if w.task is not None]
            deadlines += [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
            ready = wait([w.results for w in self._workers], timeout=max(0.0, min(deadlines) - now))
            for w in [w for w in self._workers if w.results in ready]:
                try:
                    message = json.loads(w.results.recv_bytes())
                except (EOFError, OSError):
                    if not w.ready:
                        self._replace(w)
                        raise RuntimeError(
                            f"a math-verify worker exited while starting (exit code {w.proc.returncode}); "
                            f"run `{sys.executable} -c 'import math_verify'` to see why"
                        ) from None
                    if w.task is not None:
                        results[w.task] = Result("crash", detail=f"worker exited (code {w.proc.poll()})")
                    self._replace(w)
                    continue
                if not w.ready:
                    self._started(w, message)
                    continue
                task_id, status, score, detail = message
                results[task_id] = Result(status, float(score), detail)
                w.task = None
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now >= w.deadline:
                    results[w.task] = Result("timeout", detail=f"over {self.timeout_s:g} s")
                    self._replace(w)
                elif not w.ready and now >= w.started + self.startup_timeout_s:
                    self._replace(w)
                    raise RuntimeError(
                        f"a math-verify worker did not start within {self.startup_timeout_s:g} s "
                        "(importing math-verify); raise startup_timeout_s on a slow machine"
                    )
        return results  # type: ignore[return-value]
