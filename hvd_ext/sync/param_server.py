"""``ParameterServer``: the global model z in MPI one-sided (RMA) windows.

z (float64, ``numel`` entries) is sharded over the ranks of ``comm``: rank r owns
the contiguous slice ``shards[r]`` in a window made by ``MPI.Win.Allocate``. A
worker pushes and pulls with passive-target synchronization only -- per shard
``Lock(r, SHARED)``, ``Accumulate(delta, op=SUM)``, ``Flush``, ``Get``,
``Unlock`` -- so no other rank has to take part (no barrier). Accumulates with
the same op are element-wise atomic, so concurrent pushes from several ranks sum
exactly. A second, small window on rank 0 is the *loss board*: one row per
worker ``[latest loss, local step, wall time, pushes]``, written with
``Accumulate(op=REPLACE)`` and read with ``Get_accumulate(op=NO_OP)`` (atomic
per element).

MPI world shared with Horovod: the windows live on ``comm`` (default
``mpi4py.MPI.COMM_WORLD``), i.e. the world Horovod's MPI controller uses
(``hvd.init()`` under ``horovodrun --mpi``/``mpirun``, or
``hvd.init(comm=MPI.COMM_WORLD)`` after importing mpi4py); MPI is initialised
once. Under the Gloo controller there is no MPI world and the constructor raises
RuntimeError with the fix. Needs MPI_THREAD_MULTIPLE (mpi4py's and Horovod's
default) because Horovod's background thread also calls MPI.

Passive-target progress (OpenMPI). On one node with shared memory (osc sm, or rdma over
the vader BTL) an operation on another rank's window is truly one-sided. Without it (osc ucx,
rdma over a network, or ``--mca btl tcp,self`` as the shaped-network benchmarks use) there is no
asynchronous progress: the operation waits until the target enters MPI, so pushes wait and
updates arrive stale. Horovod's background thread, which calls MPI every cycle, drives it, and so
does a progress thread. Implemented: ``progress="auto"``
(default) starts a daemon progress thread (``Iprobe`` on a private dup of
``comm`` every ``progress_interval`` s) unless all ranks share one node *and*
the shared-memory BTL is enabled (``shared_memory_rma``); ``"thread"`` forces
it, ``"none"`` disables it.
There are no dedicated server ranks: every rank is a worker and a server shard.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..exchange.transport import horovod_elastic
from ..options import Option, resolve_options

BOARD_COLS = 4  # loss, step, time, pushes

PS_OPTIONS = {
    "progress": Option(str, "auto", choices=("auto", "thread", "none"),
                       help="passive-target progress helper (see module doc)"),
    "progress_interval": Option(float, 0.002, accepted="0 < progress_interval <= 1",
                                check=lambda v: 0 < v <= 1, help="seconds between progress polls"),
}


def init_horovod(needs_mpi: bool, owner: str) -> None:
    """``hvd.init()`` for a training script; with a strategy that needs MPI one-sided operations
    (``needs_mpi``), first check the MPI controller (clear error otherwise) and share one MPI world
    between mpi4py and Horovod (``hvd.init(comm=MPI.COMM_WORLD)``)."""
    import horovod.torch as hvd

    if not needs_mpi:
        hvd.init()
        return
    require_mpi_controller(owner)
    from mpi4py import MPI

    hvd.init(comm=MPI.COMM_WORLD)


def require_mpi_controller(owner: str) -> None:
    """Raise a clear RuntimeError unless Horovod runs (or can run) with the MPI controller."""
    import os

    import horovod.torch as hvd

    gloo = bool(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")) or os.environ.get("HOROVOD_CONTROLLER") == "gloo"
    try:
        if hvd.is_initialized():
            gloo = gloo or not hvd.mpi_enabled()
    except (AttributeError, ValueError):
        pass
    if horovod_elastic():
        raise RuntimeError(f"{owner} needs MPI one-sided operations, and Horovod elastic runs on Gloo only: "
                           "use every/local/adaptive sync under elastic training, or launch without elastic "
                           "(horovodrun --mpi ... or mpirun ...)")
    if gloo or not hvd.mpi_built():
        raise RuntimeError(f"{owner} needs MPI one-sided operations: launch with the MPI controller "
                           "(horovodrun --mpi ... or mpirun ...), not with Gloo (horovodrun --gloo)")


def shared_memory_rma(comm, size: int) -> bool:
    """True when every rank is on one node and OpenMPI may use its shared-memory BTL
    (``vader``/``sm``): then passive-target RMA progresses without help."""
    import os

    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == size
    node.Free()
    btl = os.environ.get("OMPI_MCA_btl", "")
    names = {b.strip() for b in btl.split(",") if b.strip()}
    if btl.startswith("^"):
        shm_on = not ({"vader", "sm"} & {b.lstrip("^") for b in names})
    else:
        shm_on = not names or bool({"vader", "sm"} & names)
    return one_node and shm_on


class ParameterServer:
    """Global model z sharded in RMA windows + a loss board (see module doc).

    ``ParameterServer(numel, init=None, comm=None, progress="auto")`` is collective
    over ``comm``; so are ``load_state_dict``, ``barrier`` and ``close``. ``push``,
    ``pull``, ``push_pull`` and the board calls are one-sided.
    """

    def __init__(self, numel: int, init=None, comm=None, progress: str = "auto", progress_interval: float = 0.002):
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"ParameterServer: bad value {numel!r} for 'numel': accepted: integer >= 1")
        opts = resolve_options("ParameterServer", PS_OPTIONS,
                               dict(progress=progress, progress_interval=progress_interval))
        if init is not None and np.asarray(init).size != numel:
            raise ValueError(f"ParameterServer: init has {np.asarray(init).size} entries, numel is {numel}")
        require_mpi_controller("ParameterServer")
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.numel = numel
        base, rem = divmod(numel, self.size)
        counts = [base + (1 if r < rem else 0) for r in range(self.size)]
        offs = np.cumsum([0] + counts).tolist()
        self.shards: List[Tuple[int, int]] = [(offs[r], offs[r + 1]) for r in range(self.size)]
        n_local = max(counts[self.rank], 1)
        self.win = MPI.Win.Allocate(n_local * 8, 8, comm=self.comm)
        self.local = np.frombuffer(self.win.tomemory(), dtype=np.float64, count=n_local)
        nb = self.size * BOARD_COLS if self.rank == 0 else 1
        self.board_win = MPI.Win.Allocate(nb * 8, 8, comm=self.comm)
        self.board_local = np.frombuffer(self.board_win.tomemory(), dtype=np.float64, count=nb)
        self._write_local(init)
        self.board_win.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        self.board_local[:] = 0.0
        self.board_win.Unlock(self.rank)
        self.pushes = 0
        self.pulls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_s = 0.0
        self._stop = threading.Event()
        self._thread = None
        mode = opts["progress"]
        if mode == "auto":
            mode = "none" if shared_memory_rma(self.comm, self.size) else "thread"
        self.progress = mode
        if mode == "thread":
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("ParameterServer(progress='thread') needs MPI_THREAD_MULTIPLE")
            self._pcomm = self.comm.Dup()
            self._thread = threading.Thread(target=self._progress_loop, args=(opts["progress_interval"],),
                                            name="hvd_ext-rma-progress", daemon=True)
            self._thread.start()
        self.comm.Barrier()

    # ---- internals ---------------------------------------------------------------------------
    def _progress_loop(self, interval: float) -> None:
        MPI = self.MPI
        while not self._stop.is_set():
            self._pcomm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            time.sleep(interval)

    def _write_local(self, full) -> None:
        a, b = self.shards[self.rank]
        self.win.Lock(self.rank, self.MPI.LOCK_EXCLUSIVE)
        if full is None:
            self.local[:] = 0.0
        else:
            self.local[:b - a] = np.asarray(full, dtype=np.float64).reshape(-1)[a:b]
        self.win.Unlock(self.rank)

    # ---- one-sided operations ------------------------------------------------------------
    def push_pull(self, delta: Optional[np.ndarray]) -> np.ndarray:
        """z += delta (element-wise atomic Accumulate SUM, skipped when ``delta`` is None), then
        return a fresh copy of the whole z. Touches every shard, one lock epoch each; no other
        rank has to participate."""
        MPI = self.MPI
        t0 = time.perf_counter()
        out = np.empty(self.numel, dtype=np.float64)
        if delta is not None:
            delta = np.ascontiguousarray(delta, dtype=np.float64).reshape(-1)
            if delta.size != self.numel:
                raise ValueError(f"ParameterServer.push: delta has {delta.size} entries, expected {self.numel}")
        order = [(self.rank + i) % self.size for i in range(self.size)]  # spread the load over targets
        for r in order:
            a, b = self.shards[r]
            if b == a:
                continue
            self.win.Lock(r, MPI.LOCK_SHARED)
            if delta is not None:
                self.win.Accumulate(delta[a:b], r, op=MPI.SUM)
                self.win.Flush(r)
            self.win.Get(out[a:b], r)
            self.win.Unlock(r)
        if delta is not None:
            self.pushes += 1
            self.bytes_sent += 8 * self.numel
        self.pulls += 1
        self.bytes_received += 8 * self.numel
        self.wait_s += time.perf_counter() - t0
        return out

    def push(self, delta: np.ndarray) -> None:
        MPI = self.MPI
        delta = np.ascontiguousarray(delta, dtype=np.float64).reshape(-1)
        if delta.size != self.numel:
            raise ValueError(f"ParameterServer.push: delta has {delta.size} entries, expected {self.numel}")
        for r, (a, b) in enumerate(self.shards):
            if b > a:
                self.win.Lock(r, MPI.LOCK_SHARED)
                self.win.Accumulate(delta[a:b], r, op=MPI.SUM)
                self.win.Unlock(r)
        self.pushes += 1
        self.bytes_sent += 8 * self.numel

    def pull(self) -> np.ndarray:
        return self.push_pull(None)

    def post_board(self, loss: float, step: int, pushes: Optional[int] = None) -> np.ndarray:
        """Write this worker's row ``[loss, step, time, pushes]`` to the board and return the
        whole board (``size x 4``) read atomically after the write."""
        MPI = self.MPI
        row = np.array([float(loss), float(step), time.time(), float(self.pushes if pushes is None else pushes)])
        out = np.empty(self.size * BOARD_COLS, dtype=np.float64)
        self.board_win.Lock(0, MPI.LOCK_SHARED)
        self.board_win.Accumulate(row, 0, target=(self.rank * BOARD_COLS, BOARD_COLS, MPI.DOUBLE), op=MPI.REPLACE)
        self.board_win.Flush(0)
        self.board_win.Get_accumulate(np.zeros_like(out), out, 0, op=MPI.NO_OP)
        self.board_win.Unlock(0)
        return out.reshape(self.size, BOARD_COLS)

    def read_board(self) -> np.ndarray:
        MPI = self.MPI
        out = np.empty(self.size * BOARD_COLS, dtype=np.float64)
        self.board_win.Lock(0, MPI.LOCK_SHARED)
        self.board_win.Get_accumulate(np.zeros_like(out), out, 0, op=MPI.NO_OP)
        self.board_win.Unlock(0)
        return out.reshape(self.size, BOARD_COLS)

    # ---- collective --------------------------------------------------------------------------
    def barrier(self) -> None:
        self.comm.Barrier()

    def state_dict(self) -> Dict[str, Any]:
        """z, the board and this rank's counters (one-sided reads; call at a quiet point,
        e.g. right after a barrier, for a consistent snapshot)."""
        return {"numel": self.numel, "size": self.size, "z": self.pull(), "board": self.read_board().copy(),
                "counters": {"pushes": self.pushes, "pulls": self.pulls}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Collective: every rank writes its shard of the saved z; rank 0 restores the board."""
        if int(sd["numel"]) != self.numel:
            raise ValueError(f"ParameterServer.load_state_dict: checkpoint has numel {sd['numel']}, "
                             f"this server {self.numel}")
        self.comm.Barrier()
        self._write_local(np.asarray(sd["z"], dtype=np.float64))
        if self.rank == 0:
            board = np.asarray(sd["board"], dtype=np.float64).reshape(-1)
            self.board_win.Lock(0, self.MPI.LOCK_EXCLUSIVE)
            self.board_local[:] = 0.0
            k = min(board.size, self.board_local.size)
            self.board_local[:k] = board[:k]
            self.board_win.Unlock(0)
        c = sd.get("counters", {})
        self.pushes, self.pulls = int(c.get("pushes", 0)), int(c.get("pulls", 0))
        self.comm.Barrier()

    def close(self) -> None:
        """Collective: stop the progress thread and free the windows."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._pcomm.Free()
        if self.win is not None:
            self.comm.Barrier()
            self.local = self.board_local = None
            self.win.Free()
            self.board_win.Free()
            self.win = self.board_win = None
