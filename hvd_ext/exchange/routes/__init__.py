"""Routes: how one bucket of compressed tensors travels between the ranks.

One module per route; the protocol every route follows is in :mod:`.base`.

=============  ==============================================  ==========================
route          collectives                                     bytes per rank as N grows
=============  ==============================================  ==========================
allreduce      allreduce (linear codecs; PowerSGD: 2 rounds)   2(N-1)/N x payload (ring)
allgather      one allgather, decode all N                     (N-1) x payload
twophase       alltoall of shards + allgather of re-coded      2(N-1)/N x payload
               shards (:mod:`.twophase`)
sparse_rs      alltoall of (index, value) pairs by owner        ~2k pairs, flat in N
               range + allgather of re-selected (:mod:`.sparse_rs`)
node:<inner>   dense reduce-scatter in the node, <inner> on     inter-node: 1/L of the
               1/L of the bucket across nodes, dense            above per rank
               allgather in the node (:mod:`.hierarchical`)
=============  ==============================================  ==========================

``choose_route`` (:mod:`.choice`) picks one for each bucket, the same on every rank, by the price
:mod:`.pricing` gives each route.
"""
from .base import (NODE_PREFIX, OwnerMemory, Route, TensorRecord, flat_record, known_sizes,  # noqa: F401
                   make_route, register, split_flat)
# one module per route; importing registers it
from . import allreduce, allgather, twophase, sparse_rs, hierarchical  # noqa: F401,E401
from .pricing import (STEADY_STEP, codec_calls, estimated_bucket_bytes, estimated_payload_bytes,  # noqa: F401
                      flat_terms, gathered_sizes, pass_seconds, payload_bytes, priced_as_pairs, recoded_size,
                      route_cost, route_payload, sizes_known, sparse_rs_payload)
from .choice import (bucket_routes, choose_route, codec_node_aware_reason, fastest_option,  # noqa: F401
                     fastest_route, flat_routes, node_aware_reason, node_links, route_options)
