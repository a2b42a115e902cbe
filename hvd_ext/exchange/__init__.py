"""The communication seam: every collective hvd_ext makes goes through this package.

* :mod:`.transport` -- primitive collectives: Horovod's (the only calls to
  Horovod collectives in hvd_ext) and the interface a simulated world implements;
* :mod:`.core` -- :class:`Exchange`: fused buckets, the non-finite flag, byte counts;
* :mod:`.cost` -- wire bytes per collective and the alpha-beta cost model;
* :mod:`.probe` -- link measurements (latency, bandwidth, intra/inter node);
* :mod:`.routes` -- how a bucket travels: allreduce, allgather, two-phase,
  sparse reduce-scatter, node-aware (one module each) and the route choice.

The in-process N-rank world for tests lives in :mod:`hvd_ext.testing.simulated`.

The node-aware exchange needs nothing at ``hvd.init``: its node groups ride
on alltoalls of the global process set (:class:`GroupTransport`). With
``HVD_EXT_NODE_GROUPS=process_sets`` it uses Horovod process sets instead,
which must then be declared at ``hvd.init`` -- ``hvd.init(process_sets=
hvd_ext.exchange.node_process_sets())`` -- or be addable at run time --
``hvd.init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``;
without either, one warning says so and the exchange stays flat.
"""
from .core import Exchange, ExchangeStats, Pending, frame, unframe  # noqa: F401
from .transport import (GroupTransport, HorovodTransport, NodeGroupsUnavailable, Topology,  # noqa: F401
                        Transport, node_process_sets, offsets, split_sizes)
