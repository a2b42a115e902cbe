"""hvd_ext: communication-efficient gradient and parameter exchange for Horovod + PyTorch.

    opt = hvd_ext.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd_ext.compression_from_spec("topk:ratio=0.01"))
"""
from .spec import compression_from_spec, describe_compressors, list_compressors  # noqa: F401
from .compression.base import Compressor, Continue, TensorInfo  # noqa: F401
from .feedback import Feedback  # noqa: F401
from .optimizer import DistributedOptimizer  # noqa: F401
from .sync import (AdaptiveSync, EventTriggeredSGD, LocalSGD, ParameterServer,  # noqa: F401
                   sync_from_spec)
from .broadcast import broadcast_optimizer_state, broadcast_parameters  # noqa: F401  (every dtype, bf16 too)
from .plan import plan  # noqa: F401  (python -m hvd_ext.plan: will compression pay on my cluster?)

__version__ = "0.1.0"
