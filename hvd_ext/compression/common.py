"""Options every compressor takes, declared and parsed once, outside the codecs.

A codec declares only its own options (``ratio``, ``bits``...). These four belong to how the
pipeline runs any codec, so :class:`hvd_ext.compression.base.Compressor` parses them for all:

* ``route=auto|allgather|twophase`` -- how an allgather codec's bucket travels
  (:mod:`hvd_ext.exchange.routes`); a codec riding on allreduce accepts only ``auto``.
* ``hierarchy=auto|flat`` and ``hierarchy_trial=N`` -- the node-aware route (dense inside a
  node, compressed across nodes: ``docs/node-aware.md``) and the measured trial that settles it.
* ``variance=auto|freeze|live`` -- an adaptive optimizer's second moment under a lossy codec
  (:mod:`hvd_ext.variance_freeze`, 1-bit Adam).
* ``warmup=N`` -- the dense warm-up: the first N exchanges send the exact average, then the
  codec (DDP PowerSGD's ``start_powerSGD_iter``, 1-bit Adam's warm-up). Unset, the codec's
  ``default_warmup`` decides.

Old spellings stay accepted (``COMMON_ALIASES``): ``exchange=`` for ``route=``,
``variance_warmup=`` for ``warmup=``.
"""
from __future__ import annotations

from ..options import Option, non_negative

COLLECTIVES = ("allreduce", "allgather")
ROUTE_CHOICES = ("auto", "allgather", "twophase")
HIERARCHY_CHOICES = ("auto", "flat")
VARIANCE_CHOICES = ("auto", "freeze", "live")

COMMON_OPTIONS = {
    "route": Option(str, "auto", choices=ROUTE_CHOICES,
                    help="allgather codecs: allgather (every rank receives every payload), twophase (shards reduced "
                         "by their owner, bytes per rank flat in N), auto (the cost model chooses)"),
    "hierarchy": Option(str, "auto", choices=HIERARCHY_CHOICES,
                        help="auto: node-aware exchange (dense inside a node, compressed across nodes) on "
                             "multi-node jobs when the cost model says it pays; flat: never"),
    "hierarchy_trial": Option(int, 20, "int >= 0", non_negative,
                              help="with hierarchy=auto on a multi-node job: exchanges each of flat and node-aware "
                                   "runs when the cost model predicts them within 3x (0: trust the model)"),
    "variance": Option(str, "auto", choices=VARIANCE_CHOICES,
                       help="auto: with Adam/AdamW/NAdam/RAdam/RMSprop/Adagrad and a lossy codec, dense warm-up "
                            "then the optimizer's second moment frozen (1-bit Adam); freeze: always; live: never"),
    "warmup": Option(int, None, "int >= 0", non_negative,
                     help="dense exchanges first (the exact average), then the codec; unset: the codec's default"),
}
COMMON_ALIASES = {"exchange": "route", "variance_warmup": "warmup"}
