"""How a rank waits for a collective it started: spin, or sleep when ranks share cores.

Horovod's ``synchronize`` spins (poll, ``yield``, poll) until its background thread completes
the handle. While a rank has a core of its own, the ``yield`` hands that core to its background
thread, which does the transfer, and the spin costs little. When a node runs more ranks than it has
cores, the spinning threads take the cores from the other ranks' background threads and compute,
which the collective waits for, and a step can take several times as long. So, as Open MPI stops
busy-waiting when it finds a node oversubscribed (its ``mpi_yield_when_idle``), a rank with less
than a core of its own (counting its container's CPU quota) polls and sleeps. Each sleep is an
eighth of the time waited so far, between ``FIRST_SLEEP_S`` and ``MAX_SLEEP_S``: a completion is
noticed at most that late.

``HVD_EXT_WAIT`` = ``auto`` (default: the rule above) | ``spin`` | ``sleep``. The choice is this
rank's alone: it changes when a rank notices a completed collective, never which collectives run.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

WAIT_MODES = ("auto", "spin", "sleep")
FIRST_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
CORES_TO_SPIN = 1.0


CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpus() -> Optional[float]:
    """The CPU quota of this process's cgroup in cores (a container's limit), None without one."""
    try:
        quota, period = _read(CGROUP_V2_CPU_MAX).split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota, period = (int(_read(path)) for path in CGROUP_V1_QUOTA)
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def cores_per_rank(local_size: int) -> float:
    """The cores this rank can count on: those it may run on (within its container's quota), shared
    with the other ranks of its node unless it is bound to its own."""
    try:
        mine = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        mine = float(os.cpu_count() or 1)
    node = float(os.cpu_count() or mine)
    quota = cgroup_cpus()
    if quota is not None:
        mine, node = min(mine, quota), min(node, quota)
    return min(mine, node / max(int(local_size), 1))


def wait_mode(local_size: int) -> str:
    """``spin`` or ``sleep`` for a rank with ``local_size`` ranks on its node (``HVD_EXT_WAIT``)."""
    mode = os.environ.get("HVD_EXT_WAIT", "auto").strip().lower() or "auto"
    if mode not in WAIT_MODES:
        raise ValueError(f"HVD_EXT_WAIT must be one of {', '.join(WAIT_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "spin" if cores_per_rank(local_size) >= CORES_TO_SPIN else "sleep"


def sleep_until(done: Callable[[], bool]) -> None:
    """Return once ``done()`` is true, sleeping between polls (module doc)."""
    start = time.perf_counter()
    while not done():
        waited = time.perf_counter() - start
        time.sleep(min(max(waited / 8.0, FIRST_SLEEP_S), MAX_SLEEP_S))
