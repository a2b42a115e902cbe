"""hvd_ext.exchange.probe: link measurements, the fit, the HVD_EXT_NODE_LINKS setting."""
import math

import pytest

import hvd_ext
from hvd_ext.exchange import cost
from hvd_ext.exchange.routes import choose_route
from hvd_ext.exchange.transport import Topology
from hvd_ext.testing.simulated import SimulatedWorld

from helpers.nodes import _Ex


@pytest.mark.parametrize("groups", ["subworld", "alltoall"])
def test_node_link_measurement_is_the_same_on_every_rank(groups):
    """probe.measure_node_model runs its collectives in the same order on every rank (intra and inter
    groups, small and large) and averages the timings: every rank holds the same, positive model.
    A simulated world's Exchange does not measure (its links are thread hand-offs): defaults."""
    from hvd_ext.exchange import Exchange, probe

    def body(rank, t):
        ex = Exchange(transport=t)
        m = probe.measure_node_model(ex, reps=2)["model"]
        default = Exchange(transport=t)
        d = default.node_model()
        return m, d, default.node_links["source"]

    out = SimulatedWorld(6, ranks_per_node=3, groups=groups).run(body)
    models = [m for m, _, _ in out]
    assert all(m == models[0] for m in models)
    for link in (models[0].intra, models[0].inter):
        assert link.alpha > 0 and link.bandwidth > 0 and math.isfinite(link.bandwidth)
    assert all(d == cost.NodeModel() and src == "cost model defaults" for _, d, src in out)


def test_node_links_setting(monkeypatch):
    from hvd_ext.exchange import probe

    assert probe.node_links_setting() == "measure"
    monkeypatch.setenv("HVD_EXT_NODE_LINKS", "default")
    assert probe.node_links_setting() == "default"
    monkeypatch.setenv("HVD_EXT_NODE_LINKS", "fast")
    with pytest.raises(ValueError, match="HVD_EXT_NODE_LINKS must be one of measure, default, got 'fast'"):
        probe.node_links_setting()
    # raised by the route choice before the node groups (whose layout allgather is a collective) are made
    ex = _Ex(Topology(0, 2, 0, 2))
    ex.node_exchanges = lambda: pytest.fail("node groups made before the setting was checked")
    with pytest.raises(ValueError, match="HVD_EXT_NODE_LINKS"):
        choose_route(hvd_ext.compression_from_spec("qsgd:bits=8"), "auto", 10 ** 6, 4, exchange=ex)


def test_link_fit_recovers_alpha_and_bandwidth():
    from hvd_ext.exchange import probe

    alpha, bw = 40e-6, 2e9
    t = lambda wire, msgs: msgs * alpha + wire / bw  # noqa: E731
    link = probe.fit(t(1e3, 3), t(1e6, 3), 1e3, 1e6, 3)
    assert link.bandwidth == pytest.approx(bw, rel=1e-6) and link.alpha == pytest.approx(alpha, rel=1e-6)
