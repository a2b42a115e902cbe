"""The communication seam: every collective hvd_ext makes goes through this package.

* :mod:`.transport` -- primitive collectives: Horovod's (the only calls to
  Horovod collectives in hvd_ext) and the interface a simulated world implements;
* :mod:`.simulated` -- an in-process N-rank world for unit tests;
* :mod:`.core` -- :class:`Exchange`: fused buckets, the non-finite flag, byte counts;
* :mod:`.cost` -- wire bytes per collective and the alpha-beta cost model;
* :mod:`.twophase` and :mod:`.sparse_rs` -- the scalable compressed exchanges
  (two-phase compressed allreduce; sparse reduce-scatter).
"""
from .core import Exchange, ExchangeStats, Pending, frame, unframe  # noqa: F401
from .simulated import SimulatedTransport, SimulatedWorld, run_world  # noqa: F401
from .transport import HorovodTransport, Transport, offsets, split_sizes  # noqa: F401
