"""The bottom layer: tensor operations every other part of hvd_ext builds on (no hvd_ext imports).

* :mod:`.device` -- host or device, and the few sanctioned ways to move a value between them:
  one read per collective, non-blocking uploads, device-side flags and checks read once per step.
"""
