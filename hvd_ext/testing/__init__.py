"""Testing aids that run hvd_ext's real code on a machine without a GPU or a cluster.

* :mod:`.device` -- an emulated GPU: CPU data behind tensors that say they are CUDA tensors, so
  the data path takes the code a GPU user runs, and every host-device synchronisation that code
  would make is counted.
* :mod:`.simulated` -- an in-process N-rank world (threads) behind the transport interface;
* :mod:`.harness` -- :func:`run_pipeline`: the real gradient pipeline on N simulated ranks;
* :mod:`.syncs` -- the per-step count of host-device synchronisations, per codec and route.
"""
