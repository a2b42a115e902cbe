"""Overlap: compress a bucket on a worker thread while backward goes on.

Without it, a bucket is compressed inside the backward hook that completes it,
so backward waits for the codec. With it, the hook only hands the bucket to one
worker thread (first in, first out) and returns; the worker compensates,
compresses and starts the bucket's first collective while the main thread
computes the gradients of earlier layers, and Horovod's background thread sends
the buckets already started. This is the CPU form of the overlap that DDP and
Horovod get from CUDA streams (compute, compression and communication of
successive buckets in flight at once); the codec's torch kernels release the
GIL, so the two threads run in parallel when the rank has a spare core.

Same numbers as without overlap: the worker runs the buckets in the order the
hooks completed them, every codec draws its randomness from its own counter-
based generator, and ``finish`` (``synchronize``) waits for the worker before it
reads any result. Which thread starts a collective does not matter to Horovod,
which matches collectives by name.

``overlap="auto"`` (the optimizer's default) turns it on where it can pay: a
CPU model and at least two cores per local rank (``os.sched_getaffinity``
divided by Horovod's local size); on one core per rank the worker only adds
thread switches. On a GPU the worker issues its kernels on the stream current
where the bucket was completed (the one backward produced the gradients on,
so ordering is unchanged) and takes the host-side work -- Python,
kernel launches, the per-bucket device-to-host flag copy -- off backward's
path; ``overlap=True`` asks for it, ``auto`` leaves it off there until it is
measured on a GPU.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Callable, Optional

import torch

ACCEPTED = ("auto", True, False)


def check_overlap(value) -> None:
    """Raise ValueError unless ``value`` is one of ``ACCEPTED`` (before any collective)."""
    if not any(value is a or (isinstance(value, str) and value == a) for a in ACCEPTED):
        raise ValueError(f"overlap must be 'auto', True or False; got {value!r}")


def cores_per_rank(local_size: int) -> int:
    """Cores this process may run on, shared among the ``local_size`` ranks of its node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return cores // max(1, int(local_size))


def resolve_overlap(value, device: Optional[torch.device], local_size: int) -> bool:
    """``auto``: on for a CPU model with at least two cores per local rank; True/False as given."""
    check_overlap(value)
    if value is True or value is False:
        return value
    if device is not None and device.type != "cpu":
        return False
    return cores_per_rank(local_size) >= 2


class CodeWorker:
    """One daemon thread that runs submitted jobs in order; ``drain`` waits for all of them and
    re-raises the first exception one raised (later jobs are dropped after a failure, as the step
    they belong to cannot complete)."""

    def __init__(self, name: str = "hvd_ext-code"):
        self._name = name
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._pending = 0
        self._idle = threading.Condition()

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._error is None:
                    with torch.no_grad():  # grad mode is per thread; the codecs build no graph
                        job()
            except BaseException as e:  # handed to the main thread by drain()
                self._error = e
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def drain(self) -> None:
        """Wait until every submitted job has run; raise the first error of this batch."""
        with self._idle:
            while self._pending:
                self._idle.wait()
        err, self._error = self._error, None
        if err is not None:
            raise err

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5.0)
        self._thread = None
