"""hvd_ext.exchange.routes.choice: which route a bucket takes, from the spec, the cost model, the
measured links and the node layout; flat where node groups are missing or under elastic."""
import warnings

import pytest
import torch

import hvd_ext
from hvd_ext.exchange import cost
from hvd_ext.exchange.routes import choose_route
from hvd_ext.exchange.transport import Topology
from hvd_ext.testing.harness import run_pipeline

from helpers.nodes import _Ex
from helpers.simgrads import make_grads


# ---- routes chosen identically, from the spec and the cost model --------------------------------
def test_route_choice():
    c = hvd_ext.compression_from_spec
    assert choose_route(c("none"), "auto", 10 ** 6, 8) == "allreduce"
    assert choose_route(c("qsgd:bits=8"), "auto", 10 ** 6, 2) == "allgather"   # same bytes, one collective
    assert choose_route(c("qsgd:bits=8"), "auto", 10 ** 6, 8) == "twophase"
    assert choose_route(c("topk:ratio=0.01"), "auto", 10 ** 6, 8) == "sparse_rs"
    assert choose_route(c("qsgd:bits=8"), "allgather", 10 ** 6, 8) == "allgather"
    assert choose_route(c("qsgd:bits=8"), "twophase", 100, 2) == "twophase"
    assert choose_route(c("qsgd:bits=8"), "auto", 10, 64) == "allgather"      # latency-bound tiny bucket
    with pytest.raises(ValueError, match="accepted: auto"):
        choose_route(c("fp16"), "twophase", 10, 4)
    with pytest.raises(ValueError, match="bad value 'ring' for 'exchange'"):  # named as the user spelled it
        c("qsgd:exchange=ring")
    with pytest.raises(ValueError, match="bad value 'ring' for 'route'"):
        c("qsgd:route=ring")
    assert c("qsgd:bits=8,route=twophase").spec() == "qsgd:bits=8,route=twophase"
    assert c("qsgd:bits=8,exchange=twophase").spec() == "qsgd:bits=8,route=twophase"  # the old key


def test_sparse_route_priced_as_the_sparse_reduce_scatter_sends():
    """fp16 values over owner ranges wider than 65536 entries: the sparse reduce-scatter sends
    32-bit indices and float32 sums, more than the allgather of the codec's own payload at 3 ranks,
    so the bucket takes the allgather (priced with the codec's payload, both looked alike)."""
    from hvd_ext.compression._sparse import count_for
    from hvd_ext.exchange.routes import estimated_payload_bytes
    from hvd_ext.exchange.routes.sparse_rs import expected_wire

    comp, n, size = hvd_ext.compression_from_spec("topk:ratio=0.01,values=fp16"), 10 ** 7, 3
    gather_wire = (size - 1) * estimated_payload_bytes(comp, n)
    assert expected_wire([n], [count_for(0.01, n)], size, comp.value_dtype) > gather_wire
    assert choose_route(comp, "auto", n, size) == "allgather"
    assert choose_route(hvd_ext.compression_from_spec("topk:ratio=0.01"), "auto", n, 8) == "sparse_rs"


def test_route_choice_on_nodes():
    c = hvd_ext.compression_from_spec
    two_by_two = _Ex(Topology(0, 2, 0, 2))
    n = 10 ** 6
    assert choose_route(c("qsgd:bits=8"), "auto", n, 4, exchange=two_by_two).startswith("node:")
    assert choose_route(c("topk:ratio=0.01"), "auto", n, 4, exchange=two_by_two).startswith("node:")
    assert choose_route(c("qsgd:bits=8"), "twophase", n, 4, exchange=two_by_two) == "node:twophase"
    assert choose_route(c("topk:ratio=0.01"), "twophase", n, 4, exchange=two_by_two) == "node:sparse_rs"
    assert choose_route(c("none"), "auto", n, 4, exchange=two_by_two) == "node:allreduce"
    # flat: asked for, one node, one rank per node, uneven nodes, codecs/feedbacks it cannot carry
    assert choose_route(c("qsgd:bits=8,hierarchy=flat"), "auto", n, 4, exchange=two_by_two) == \
        choose_route(c("qsgd:bits=8"), "auto", n, 4) == "twophase"
    for topo in (Topology(0, 4, 0, 1), Topology(0, 1, 0, 4), Topology(0, 2, 0, 2, homogeneous=False)):
        assert not choose_route(c("qsgd:bits=8"), "auto", n, 4, exchange=_Ex(topo)).startswith("node:")
    assert choose_route(c("powersgd:rank=2"), "auto", n, 4, exchange=two_by_two) == "allreduce"
    assert not choose_route(c("dgc:ratio=0.01"), "auto", n, 4, exchange=two_by_two).startswith("node:")
    assert choose_route(c("qsgd:bits=8"), "auto", 1000, 2) == "allgather"  # no exchange given: flat as before


def test_the_route_choice_prices_each_route_as_the_planner_does():
    """Across nodes, each route's seconds in the job's choice (flat and node-aware, the sparse
    reduce-scatter's pairs, the allgather's framed payload) are the planner's for the same bucket on
    the same links at the same codec speed, and the job takes the fastest of them."""
    from hvd_ext.exchange.routes import route_options
    from hvd_ext.plan import plan
    from hvd_ext.plan.model import codec_timing

    two_by_two, model = _Ex(Topology(0, 2, 0, 2)), cost.NodeModel()
    for spec in ("topk:ratio=0.01", "topk:ratio=0.01,values=fp16", "qsgd:bits=8"):
        comp = hvd_ext.compression_from_spec(spec)
        for n in (10 ** 4, 10 ** 6, 10 ** 7):
            p = plan([(n,)], compute_s=0.0, cluster=None, nodes=2, gpus_per_node=2, intra=model.intra,
                     inter=model.inter, device="cpu", methods=[spec], breakeven_search=False, optimizer="none")
            rows = {r.route: r.buckets[0].seconds for r in p.rows if r.spec == spec}
            opts = route_options(comp, "auto", [(n,)], 4, exchange=two_by_two, model=model,
                                 codec=codec_timing(spec, p.cluster).speed)
            assert opts["flat_s"] == pytest.approx(rows[opts["flat"]], rel=1e-9), (spec, n, opts, rows)
            assert opts["node_s"] == pytest.approx(rows[opts["node"]], rel=1e-9), (spec, n, opts, rows)
            assert opts["flat_s"] == pytest.approx(min(t for r, t in rows.items() if not r.startswith("node:")))
            assert opts["node_s"] == pytest.approx(min(t for r, t in rows.items() if r.startswith("node:")))


@pytest.mark.parametrize("device, preset", [("cpu", "cpu"), ("cuda", "v100")])
def test_an_untimed_codec_is_priced_at_the_planners_default_for_its_family_and_device(device, preset):
    """With no codec speed and no calibration file, the job prices a codec's calls at its family's
    speed on its device, as the planner does by default: each route's seconds are the planner's
    (a GPU's as a V100's, the planner's preset; the CPU figure would price it tens of times too slow)."""
    from hvd_ext.exchange.routes import route_options
    from hvd_ext.plan import plan

    two_by_two, model = _Ex(Topology(0, 2, 0, 2)), cost.NodeModel()
    for spec in ("topk:ratio=0.01", "qsgd:bits=8", "fp16"):  # (codecs with a node-aware route: priced on the links)
        comp = hvd_ext.compression_from_spec(spec)
        for n in (10 ** 5, 10 ** 7):
            shapes = [(n // 1000, 1000)]
            p = plan(shapes, compute_s=0.0, cluster=None, nodes=2, gpus_per_node=2, intra=model.intra,
                     inter=model.inter, device=preset, methods=[spec], breakeven_search=False, optimizer="none")
            rows = {r.route: r.buckets[0].seconds for r in p.rows if r.spec == spec}
            opts = route_options(comp, "auto", shapes, 4, exchange=two_by_two, model=model, device=device)
            assert opts["flat_s"] == pytest.approx(rows[opts["flat"]], rel=1e-9), (spec, n, opts, rows)
            assert opts["node_s"] == pytest.approx(rows[opts["node"]], rel=1e-9), (spec, n, opts, rows)


def test_every_rank_prices_an_untimed_codec_alike_whatever_its_gpu(monkeypatch):
    """The ranks of a mixed cluster choose the same routes: a GPU's codec speed does not depend on
    which GPU a rank has, nor on its index; it is a GPU's figure, far above a CPU core's."""
    from hvd_ext.exchange import codec_speed

    speeds = []
    for name in ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3", "Tesla T4"):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, name=name: name)
        speeds += [codec_speed.pass_speed("qsgd", d) for d in ("cuda", "cuda:1", torch.device("cuda", 3))]
    assert len(set(speeds)) == 1
    assert speeds[0] > 10 * codec_speed.pass_speed("qsgd", "cpu") == 10 * codec_speed.pass_speed("qsgd", None)


def test_route_choice_follows_the_measured_links():
    """The node-aware route is taken by the exchange's node model (measured links), not by constants:
    a slow inter-node link makes it node-aware, a node whose own link is the slow one makes it flat;
    ``codec`` (auto's measured codec speed) enters the model; no model is asked for a flat spec."""
    c = hvd_ext.compression_from_spec
    n = 10 ** 6
    slow_inter = cost.NodeModel(intra=cost.LinkModel(alpha=5e-6, bandwidth=5e9),
                                inter=cost.LinkModel(alpha=50e-6, bandwidth=37.5e6))
    slow_intra = cost.NodeModel(intra=cost.LinkModel(alpha=50e-6, bandwidth=50e6),
                                inter=cost.LinkModel(alpha=50e-6, bandwidth=10e9))
    for spec in ("qsgd:bits=8", "topk:ratio=0.01", "none"):
        ex = _Ex(Topology(0, 2, 0, 2), model=slow_inter)
        assert choose_route(c(spec), "auto", n, 4, exchange=ex).startswith("node:"), spec
        assert ex.models_asked == 1
        assert not choose_route(c(spec), "auto", n, 4, exchange=_Ex(Topology(0, 2, 0, 2), model=slow_intra)) \
            .startswith("node:"), spec
    # codec speed: the flat allgather decodes (1 + N) n elements per rank, the node-aware one (1 + M) n/L;
    # with a slow enough codec that outweighs the slow intra-node link
    assert not choose_route(c("qsgd:bits=8"), "allgather", n, 4, exchange=_Ex(Topology(0, 2, 0, 2), model=slow_intra),
                            codec=1e9).startswith("node:")
    assert choose_route(c("qsgd:bits=8"), "allgather", n, 4, exchange=_Ex(Topology(0, 2, 0, 2), model=slow_intra),
                        codec=1e6) == "node:allgather"
    flat = _Ex(Topology(0, 2, 0, 2), model=slow_inter)
    choose_route(c("qsgd:bits=8,hierarchy=flat"), "auto", n, 4, exchange=flat)
    assert flat.models_asked == 0


def test_no_process_sets_one_warning_and_flat():
    from hvd_ext.exchange.routes import choice

    choice._warned.clear()
    grads = make_grads(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = run_pipeline("qsgd:bits=8", grads, 4, ranks_per_node=2, process_sets=False)
    assert all(r.routes == ["allgather"] for r in runs)
    msgs = [str(w.message) for w in caught if "node-aware" in str(w.message)]
    assert len(msgs) == 1 and "process sets" in msgs[0], msgs


def test_elastic_jobs_stay_flat(monkeypatch):
    """Under Horovod elastic the world (and its nodes) can change and construction must not communicate."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert choose_route(hvd_ext.compression_from_spec("qsgd:bits=8"), "auto", 10 ** 6, 4,
                        exchange=_Ex(Topology(0, 2, 0, 2))) == "twophase"


def test_route_choice_prices_the_buckets_tensors(monkeypatch):
    """Given the bucket's tensor shapes (or sizes), the choice prices the layout with the planner's
    own payload (:func:`hvd_ext.exchange.routes.payload_bytes`; a codec whose payload depends on it:
    qdist's budget is allocated over the layers, PowerSGD's factors follow the matrix shapes)."""
    from hvd_ext.exchange.routes import choice
    from hvd_ext.plan.model import payload_bytes as planners
    from hvd_ext.spec import compression_from_spec

    seen, price = [], choice.payload_bytes

    def spy(comp, shapes, *args, **kw):
        seen.append(list(shapes))
        return price(comp, shapes, *args, **kw)
    monkeypatch.setattr(choice, "payload_bytes", spy)
    assert planners is price
    sizes = [4096 * 64, 64, 1024, 10]
    choice.choose_route(compression_from_spec("qdist:budget=2.5"), "auto", sizes, 4)
    assert seen and all(s == [(n,) for n in sizes] for s in seen)
    seen.clear()
    shapes = [(64, 4096), (64,), (32, 32), (10,)]
    choice.choose_route(compression_from_spec("powersgd:rank=2"), "auto", shapes, 4)
    assert seen == [shapes]
    assert choice.choose_route(compression_from_spec("qdist:budget=2.5"), "auto", sum(sizes), 4) in ("allgather",
                                                                                                  "twophase")
    import torch
    assert choice.tensor_shapes(torch.Size([3, 4])) == [(3, 4)] == choice.tensor_shapes([torch.Size([3, 4])])
    assert choice.tensor_shapes(12) == [(12,)] == choice.tensor_shapes([12])


def test_a_gpu_buckets_route_choice_prices_nccls_tree():
    """On GPU tensors the job's route choice prices an allreduce as NCCL runs it (the model's ``tree``),
    as the planner does on a GPU cluster; on CPU tensors the ring."""
    from hvd_ext.exchange.bucket_cost import Network, flat_cost
    from hvd_ext.exchange.routes import route_options

    model = cost.NodeModel(intra=cost.LinkModel(alpha=5e-6, bandwidth=1e11),
                           inter=cost.LinkModel(alpha=30e-6, bandwidth=1e10))
    comp = hvd_ext.compression_from_spec("none")
    n = 10 ** 6
    opts = {dev: route_options(comp, "auto", n, 1024, exchange=_Ex(Topology(0, 8, 0, 128), model=model), device=dev)
            for dev in ("cpu", "cuda")}
    for dev, tree in (("cuda", True), ("cpu", False)):
        net = Network(128, 8, model.intra, model.inter, allreduce_tree=tree)
        assert opts[dev]["flat_s"] == pytest.approx(flat_cost("allreduce", n, 4 * n, 0.0, 0.0, net).seconds)
    assert opts["cuda"]["flat_s"] < opts["cpu"]["flat_s"] - 0.05   # 2046 ring latencies against 28
    assert opts["cuda"]["node_s"] < opts["cpu"]["node_s"]


def test_a_flat_job_across_nodes_prices_its_routes_on_the_files_node_links(tmp_path, monkeypatch):
    """hierarchy=flat across nodes makes no node groups and measures no node links; where the calibration
    file timed this world's node links, the flat routes are priced on them (a node's NIC carries its
    ranks' off-node traffic), as the planner prices them; without the file, on one default link."""
    import json

    from hvd_ext.exchange import calibration, codec_speed
    from hvd_ext.exchange.bucket_cost import Network, flat_cost
    from hvd_ext.exchange.routes import route_options

    comp = hvd_ext.compression_from_spec("fp16:hierarchy=flat")
    ex, n = _Ex(Topology(0, 2, 0, 2)), 10 ** 6
    cal = {"version": 1, "ranks": 4, "nodes": 2, "local": 2,
           "links": {"flat": {"lat": 1e-4, "bandwidth": 1e9}, "intra": {"alpha": 1e-5, "bandwidth": 1e10},
                     "inter": {"alpha": 2e-5, "bandwidth": 1e7}}}
    default = route_options(comp, "auto", n, 4, exchange=ex)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    monkeypatch.setenv(calibration.ENV, str(path))
    monkeypatch.setattr(calibration, "_CACHE", {})
    opts = route_options(comp, "auto", n, 4, exchange=ex)
    assert opts["node"] is None and ex.models_asked == 0   # flat: no node links measured
    links = calibration.node_model(cal)
    net = Network(2, 2, links.intra, links.inter)
    cast = n / codec_speed.pass_speed("fp16")   # not timed by the file: the family's speed on a CPU
    own = flat_cost("allreduce", n, 2 * n, cast, cast, net, collectives=("alltoall", "allgather"))
    assert opts["flat_s"] == pytest.approx(own.seconds, rel=1e-9)  # a CPU: hvd_ext sums float16 itself
    assert opts["flat_s"] > 10 * default["flat_s"]
