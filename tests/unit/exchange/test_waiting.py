"""hvd_ext.exchange.waiting: a rank spins while it has a core of its own and sleeps when its node
runs more ranks than cores; a sleeping wait notices a completion at most an eighth of its wait late."""
import pytest

from hvd_ext.exchange import waiting


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Pretend this machine has ``cores`` cores and this process may run on ``mine`` of them; its
    container's CPU quota is read from ``tmp_path / "cpu.max"`` (none unless a test writes it)."""
    def set_(cores, mine=None):
        monkeypatch.setattr(waiting.os, "cpu_count", lambda: cores)
        monkeypatch.setattr(waiting.os, "sched_getaffinity", lambda pid: set(range(mine or cores)), raising=False)
    monkeypatch.setattr(waiting, "CGROUP_V2_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(waiting, "CGROUP_V1_QUOTA", (str(tmp_path / "quota"), str(tmp_path / "period")))
    monkeypatch.delenv("HVD_EXT_WAIT", raising=False)
    return set_


@pytest.mark.parametrize("cores,mine,local,mode", [
    (2, None, 4, "sleep"),   # more ranks than cores
    (2, None, 3, "sleep"),
    (2, None, 2, "spin"),    # a core each
    (96, None, 8, "spin"),   # a GPU node
    (16, 1, 8, "spin"),      # bound to a core of its own
    (16, 1, 32, "sleep"),    # bound, but the node runs more ranks than cores
])
def test_auto_sleeps_exactly_when_ranks_outnumber_cores(machine, cores, mine, local, mode):
    machine(cores, mine)
    assert waiting.wait_mode(local) == mode


@pytest.mark.parametrize("cpu_max,mode", [("400000 100000", "sleep"), ("max 100000", "spin"),
                                           ("1600000 100000", "spin")])
def test_a_containers_cpu_quota_counts_as_its_cores(machine, tmp_path, cpu_max, mode):
    machine(64)  # 8 ranks on a 64-core host, in a container of 4 cores (sleep), no limit or 16 (spin)
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    assert waiting.wait_mode(8) == mode


def test_environment_overrides_the_rule_and_bad_values_are_named(machine, monkeypatch):
    machine(2)
    monkeypatch.setenv("HVD_EXT_WAIT", "sleep")
    assert waiting.wait_mode(1) == "sleep"
    monkeypatch.setenv("HVD_EXT_WAIT", "SPIN")
    assert waiting.wait_mode(8) == "spin"
    monkeypatch.setenv("HVD_EXT_WAIT", "poll")
    with pytest.raises(ValueError, match=r"HVD_EXT_WAIT must be one of auto, spin, sleep, got 'poll'"):
        waiting.wait_mode(2)


@pytest.mark.parametrize("done_at", [0.0, 5e-6, 3e-4, 0.02, 2.0])
def test_sleeping_wait_is_late_by_at_most_an_eighth_of_its_wait(monkeypatch, done_at):
    clock = {"t": 0.0, "sleeps": []}

    def sleep(s):
        clock["sleeps"].append(s)
        clock["t"] += s

    monkeypatch.setattr(waiting.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(waiting.time, "sleep", sleep)
    waiting.sleep_until(lambda: clock["t"] >= done_at)
    late = clock["t"] - done_at
    assert late >= 0
    assert late <= max(waiting.FIRST_SLEEP_S, min(done_at / 8 * 1.01, waiting.MAX_SLEEP_S)) + 1e-12
    assert all(waiting.FIRST_SLEEP_S <= s <= waiting.MAX_SLEEP_S for s in clock["sleeps"])
    assert len(clock["sleeps"]) <= 100 + done_at / waiting.MAX_SLEEP_S  # polls grow with the wait, not per microsecond


def test_horovod_transport_refuses_an_unknown_wait():
    hvd_transport = pytest.importorskip("hvd_ext.exchange.transport")
    pytest.importorskip("horovod.torch")
    with pytest.raises(ValueError, match="wait must be 'spin', 'sleep' or None"):
        hvd_transport.HorovodTransport(wait="busy")
