"""Testing aids that run hvd_ext's real code on a machine without a GPU or a cluster.

* :mod:`.device` -- an emulated GPU: CPU data behind tensors that say they are CUDA tensors, so
  the data path takes the code a GPU user runs, and every host-device synchronisation that code
  would make is counted.
"""
