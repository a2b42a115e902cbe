"""The threshold codec (hvd_ext.compression.threshold)."""
import torch

from hvd_ext.compression._sparse import payload_bytes
from hvd_ext.spec import compression_from_spec

from helpers.sparse import selected


def test_threshold_selects_strictly_above_tau():
    x = torch.tensor([0.5, -0.6, 0.25, 0.0, -0.25, 0.7])
    c = compression_from_spec("threshold:tau=0.25")
    idx, payload = selected(c, x)
    assert idx == [0, 1, 5]
    assert payload.numel() == payload_bytes(6, 3, 4) and c.wire_bytes(6) is None
