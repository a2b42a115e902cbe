"""compression="auto" (hvd_ext.auto): spec parsing, common decisions, calibration and trials,
error-feedback carry-over (simulated ranks)."""
from __future__ import annotations

import pytest
import torch

import hvd_ext
from hvd_ext.auto import DEFAULT_CANDIDATES, WARMED_UP, AutoCompression, AutoTuner
from hvd_ext.exchange import cost
from hvd_ext.exchange.bucket_cost import flat_cost
from hvd_ext.exchange.routes import pricing
from hvd_ext.spec import split_candidates
from hvd_ext.testing.harness import run_pipeline

from helpers.auto import NAMES, _grads, _link


def test_spec_parsing_and_errors():
    assert split_candidates("none,fp16,topk:ratio=0.01,scope=layer,qsgd:bits=8") == \
        ["none", "fp16", "topk:ratio=0.01,scope=layer", "qsgd:bits=8"]
    c = hvd_ext.compression_from_spec("auto")
    assert isinstance(c, AutoCompression) and c.candidate_specs == list(DEFAULT_CANDIDATES)
    assert c.spec() == "auto" and c.feedback.name == "residual"
    c = hvd_ext.compression_from_spec("auto:every=7,candidates=none,topk:ratio=0.05,scope=layer")
    assert c.every == 7 and c.candidate_specs == ["none", "topk:ratio=0.05,scope=layer"]
    assert hvd_ext.compression_from_spec(c.spec()).candidate_specs == c.candidate_specs  # spec round-trips
    for bad, words in [("auto:foo=1", "foo"), ("auto:every=0", "every"), ("auto:candidates=auto", "auto"),
                       ("auto:candidates=none,topk:ratio=0.01,feedback=ewma", "ewma"),
                       ("auto:candidates=nosuch", "nosuch"), ("auto:candidates=none,none", "twice")]:
        with pytest.raises(ValueError, match=words):
            hvd_ext.compression_from_spec(bad)


def test_a_rank_resuming_behind_takes_the_decision_not_the_debt(monkeypatch):
    """The resume agreement (GradientPipeline.shared_state_dict): a behind rank takes the most
    advanced rank's choice and calibration, never its debt (a replaced codec's memory: per rank)."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    spec = "auto:warmup=2,accuracy=relaxed,candidates=none,topk:ratio=0.1,scope=layer,route=allgather"
    root = run_pipeline(spec, _grads(6, 2), 2, bucket_bytes=8000)[0].pipeline
    lag = run_pipeline(spec, _grads(1, 2), 2, bucket_bytes=8000)[1].pipeline
    root.auto.debt, root.auto.debt_left = {"w1": torch.ones(3)}, {"w1": 5}
    lag.auto.debt, lag.auto.debt_left = {"b1": torch.full((2,), 7.0)}, {"b1": 9}
    shared = root.shared_state_dict()
    assert "debt" not in shared["auto"] and "debt_left" not in shared["auto"]
    assert root.auto.last_eval is not None and lag.auto.last_eval is None
    lag.load_shared_state_dict(shared)
    assert lag.auto.choice == root.auto.choice and lag.auto.last_eval == root.auto.last_eval
    assert [b.route.name for b in lag.buckets] == [b.route.name for b in root.buckets]
    assert set(lag.auto.debt) == {"b1"} and lag.auto.debt_left == {"b1": 9}


@pytest.mark.parametrize("size", [2, 3])
def test_dense_until_warmup_then_same_choice_everywhere(monkeypatch, size):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    grads = _grads(6, size)
    spec = "auto:warmup=2,accuracy=relaxed,candidates=none,topk:ratio=0.1,scope=layer,route=allgather"
    runs = run_pipeline(spec, grads, size, bucket_bytes=8000)
    for step in range(2):  # dense: the exact mean
        for n in NAMES:
            mean = sum(grads[step][r][n] for r in range(size)) / size
            for r in runs:
                torch.testing.assert_close(r.results[step][n], mean)
    for r in runs:
        assert r.pipeline.auto.report()["choice"] == runs[0].pipeline.auto.report()["choice"]
        assert set(r.pipeline.auto.report()["choice"]) == {"topk:ratio=0.1,scope=layer,route=allgather"}
        assert [b.route.name for b in r.pipeline.buckets] == ["allgather"] * len(r.pipeline.buckets)
        for step in range(6):
            for n in NAMES:
                assert torch.equal(r.results[step][n], runs[0].results[step][n])
    # after the switch the bytes fall to the sparse payload
    assert runs[0].received[-1] < 0.35 * runs[0].received[0]


def test_fast_link_keeps_dense(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())
    runs = run_pipeline("auto:warmup=2", _grads(3, 2), 2)
    for r in runs:
        assert set(r.pipeline.auto.report()["choice"]) == {"none"}
        d = r.pipeline.auto.decisions[0]
        assert d["reason"].startswith("warmup") and d["link"]["MB_per_s"] > 1e4


def test_memory_carries_over_when_switching_back(monkeypatch):
    """topk (slow link) for steps 2-4, then none (fast link): what topk left in the residual is paid
    out over the next ``release`` dense steps -- applied + memory + debt equal the inputs' mean at
    every step, and once the debt is paid the applied updates sum to it exactly."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0, fast_from=5))
    size, steps = 2, 10
    grads = _grads(steps, size, seed=3)
    spec = "auto:warmup=2,accuracy=relaxed,every=3,release=3,candidates=none,topk:ratio=0.05,scope=layer,route=allgather"
    seen = []

    def snapshot(rank, step, pipe):
        if rank == 0:
            t = pipe.auto
            seen.append({n: (pipe.feedback.memory.get(n), t.debt.get(n)) for n in NAMES})

    runs = run_pipeline(spec, grads, size, before_step=snapshot)
    choices = [d["choice"][0] for d in runs[0].pipeline.auto.decisions]
    assert choices[:2] == ["topk:ratio=0.05,scope=layer,route=allgather", "none"]
    assert [d["step"] for d in runs[0].pipeline.auto.decisions][:2] == [2, 5]
    pipe = runs[0].pipeline
    assert not pipe.feedback.memory and not pipe.auto.debt  # paid out over steps 5, 6, 7
    mid = seen[6]  # before step 6: a debt, no memory (none is lossless)
    assert all(m is None for m, _ in mid.values()) and all(d is not None for _, d in mid.values())
    for n in NAMES:
        # rank 0's view: its applied update is the mean; its own memory + debt is its share of what's missing
        applied = sum(runs[0].results[s][n] for s in range(steps))
        target = sum(grads[s][r][n] for s in range(steps) for r in range(size)) / size
        torch.testing.assert_close(applied, target, rtol=1e-4, atol=1e-4)
        upto5 = sum(runs[0].results[s][n] for s in range(5))
        target5 = sum(grads[s][r][n] for s in range(5) for r in range(size)) / size
        assert (upto5 - target5).abs().max() > 1e-2   # topk held some back ...
        upto6 = sum(runs[0].results[s][n] for s in range(6))
        target6 = sum(grads[s][r][n] for s in range(6) for r in range(size)) / size
        err5, err6 = (upto5 - target5).abs().max(), (upto6 - target6).abs().max()
        assert err6 < err5  # ... and pays it back over several steps, not at once
        assert err6 > 1e-3


def test_checkpoint_keeps_choice(monkeypatch):
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    spec = "auto:warmup=2,accuracy=relaxed,candidates=none,topk:ratio=0.1,scope=layer,route=allgather"
    runs = run_pipeline(spec, _grads(3, 2), 2)
    sd = runs[0].pipeline.state_dict()
    assert sd["auto"]["choice"] == runs[0].pipeline.auto.choice and sd["auto"]["choice"] != [0]

    def restore(rank, step, pipe):
        if step == 0:
            pipe.load_state_dict(sd)
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())
    runs2 = run_pipeline(spec, _grads(1, 2), 2, before_step=restore)
    assert runs2[0].pipeline.buckets[0].comp is runs2[0].pipeline.compressor.candidates[1]


def test_most_accurate_candidate_within_slack(monkeypatch):
    """Candidates are listed most accurate first: the first whose predicted time is within `slack`
    of the predicted step time of the fastest wins; with slack=0 the fastest wins."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())
    fake = {"none": 100e-3, "fp16": 52e-3, "topk": 50e-3}

    def time_codec(self, c, b, grads):
        return {"enc": float(list(fake).index(c.name)), "dec": 0.0, "bytes": 1.0}  # the codec, by index

    def predict(self, c, kind, shapes, payload, enc, dec, device_type):
        return fake[list(fake)[int(enc)]]

    monkeypatch.setattr(AutoTuner, "_time_codec", time_codec)
    monkeypatch.setattr(AutoTuner, "predict", predict)
    for slack, want in (("0.1", "fp16"), ("0", "topk:ratio=0.01"), ("2", "none")):
        runs = run_pipeline(f"auto:warmup=2,accuracy=relaxed,trial=0,slack={slack},candidates=none,fp16,topk:ratio=0.01", _grads(3, 2), 2)
        assert runs[0].pipeline.auto.report()["choice"] == [want], slack


@pytest.mark.parametrize("lat,expect", [(1.0, "allgather"), (1e-7, "twophase")])
def test_route_follows_the_measured_link(monkeypatch, lat, expect):
    """auto re-chooses each bucket's route with the link it measured: a high-latency link takes the
    allgather (N-1 messages), a low-latency slow one the two-phase exchange (half the bytes), on
    every rank alike; the default constants pick allgather for these small buckets."""
    def probe(self):
        wire = cost.allreduce_wire(4.0 * 256 * 1024, self.pipe.size)
        return {"lat": lat, "large": lat + wire / 3e4, "wire": wire}  # 30 kB/s: compression pays

    monkeypatch.setattr(AutoTuner, "_probe_link", probe)
    size = 4
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0,candidates=none,qsgd:bits=8", _grads(4, size), size)
    for r in runs:
        assert set(r.pipeline.auto.report()["choice"]) == {"qsgd:bits=8"}
        assert [b.route.name for b in r.pipeline.buckets] == [expect] * len(r.pipeline.buckets)
        for n in NAMES:
            assert torch.equal(r.results[-1][n], runs[0].results[-1][n])


def _fake_costs(monkeypatch, model, real):
    """A link and codecs whose predicted exchange seconds are ``model`` and whose exchanges 'take'
    ``real`` (per codec name), so calibration has something to learn."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())

    def time_codec(self, c, b, grads):
        return {"enc": float(list(model).index(c.name)), "dec": 0.0, "bytes": 1.0}  # the codec, by index

    def predict(self, c, kind, shapes, payload, enc, dec, device_type):
        return model[list(model)[int(enc)]]

    def exchange_time(self, seconds):
        name = self.auto.candidates[self.choice[0]].name
        self._measured.append(real[name])
        self._periods.append(real[name] + 5e-3)

    monkeypatch.setattr(AutoTuner, "_time_codec", time_codec)
    monkeypatch.setattr(AutoTuner, "predict", predict)
    monkeypatch.setattr(AutoTuner, "exchange_time", exchange_time)


def test_calibration_replaces_a_codec_slower_than_predicted(monkeypatch):
    """The model predicts top-k cheapest, but its exchanges take 4x the prediction on this 'machine'
    while qsgd's take what was predicted: once top-k has run, the measured ratio moves the choice to
    qsgd, on every rank alike; the learned ratios go into the decision log and the checkpoint."""
    model = {"none": 40e-3, "qsgd": 20e-3, "topk": 8e-3}      # predicted exchange seconds
    real = {"none": 40e-3, "qsgd": 20e-3, "topk": 32e-3}       # what the exchanges 'take'
    _fake_costs(monkeypatch, model, real)
    spec = "auto:warmup=2,accuracy=relaxed,check=2,trial=0,slack=0,candidates=none,qsgd:bits=8,topk:ratio=0.01"
    runs = run_pipeline(spec, _grads(8, 2), 2)
    for r in runs:
        tuner = r.pipeline.auto
        picks = [d["choice"] for d in tuner.decisions]
        assert picks[0] == ["topk:ratio=0.01"] and picks[-1] == ["qsgd:bits=8"], picks
        assert tuner.decisions[-1]["calibration"]["topk:ratio=0.01"] == pytest.approx(4.0)
        assert tuner.decisions[-1]["calibration"]["none"] == pytest.approx(1.0)
        assert r.pipeline.state_dict()["auto"]["calib"] == runs[0].pipeline.state_dict()["auto"]["calib"]


def test_a_more_accurate_codec_inside_the_slack_replaces_the_current_one(monkeypatch):
    """What the 1 Gbit/s run showed: top-k is predicted fastest and chosen; once it has run, its
    measured cost puts fp16 (more accurate, listed first) inside the 10% slack -- auto moves to fp16
    (before, the switching margin, meant for moves to a faster codec, kept top-k) and stays there."""
    model = {"none": 12e-3, "fp16": 6e-3, "topk": 3e-3}
    real = {"none": 12e-3, "fp16": 6e-3, "topk": 6e-3}
    _fake_costs(monkeypatch, model, real)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=2,trial=0,slack=0.1,candidates=none,fp16,topk:ratio=0.01", _grads(12, 2), 2)
    for r in runs:
        d = r.pipeline.auto.decisions
        assert [x["choice"] for x in d][:2] == [["topk:ratio=0.01"], ["fp16"]], d
        assert all(x["choice"] == ["fp16"] for x in d[1:]), d


def test_a_new_choice_is_calibrated_after_check_exchanges(monkeypatch):
    """A codec 1.5x slower than predicted stays inside the drift band [0.5x, 2x], yet once it has run
    `check` exchanges auto re-decides with its measured cost and moves to the truly faster qsgd; with
    every chosen codec calibrated it then stops re-deciding."""
    model = {"none": 40e-3, "qsgd": 9e-3, "topk": 8e-3}
    real = {"none": 40e-3, "qsgd": 9e-3, "topk": 12e-3}
    _fake_costs(monkeypatch, model, real)
    probes = []
    link = _link()
    monkeypatch.setattr(AutoTuner, "_probe_link", lambda self: probes.append(self.pipe.rank) or link(self))
    spec = "auto:warmup=2,accuracy=relaxed,check=2,trial=0,slack=0,candidates=none,qsgd:bits=8,topk:ratio=0.01"
    runs = run_pipeline(spec, _grads(12, 2), 2)
    assert sorted(probes) == [0, 1]  # the calibrate re-decisions reuse the link measured at warm-up
    for r in runs:
        d = r.pipeline.auto.decisions
        assert [x["reason"] for x in d][:3] == ["warmup", "calibrate", "calibrate"], d
        assert d[0]["choice"] == ["topk:ratio=0.01"] and d[-1]["choice"] == ["qsgd:bits=8"]
        assert len(d) == 3  # everything chosen is calibrated: no more re-decisions in 12 steps


def test_codec_trial_codes_a_bucket_as_the_pipeline_does():
    """auto times each candidate the way the pipeline runs it: top-k (scope=model) as one flat payload
    per bucket (one selection over the bucket's 5050 elements: ceil(0.01 x 5050) = 51 entries), not
    one payload per tensor (20 + 1 + 30 = 51 entries here, but three selections, three headers)."""
    from hvd_ext.compression.base import TensorInfo

    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,candidates=none,topk:ratio=0.01", _grads(1, 2), 2)
    tuner = runs[0].pipeline.auto
    b = runs[0].pipeline.buckets[0]
    grads = [torch.randn_like(p) for p in b.params]
    topk = tuner.auto.candidates[1]
    got = tuner._time_codec(topk, b, grads)
    u = torch.cat([g.reshape(-1) for g in grads])
    info = TensorInfo(name="flat", shape=u.shape, step=0, rank=0, size=2, param=None, scale=0.5,
                      segments=[(n, g.numel(), p) for n, g, p in zip(b.names, grads, b.params)])
    payload, _ = topk.compress(u, info)
    topk.discard()
    per_tensor = 0
    for n, g, p in zip(b.names, grads, b.params):
        pl, _ = topk.compress(g, TensorInfo(name=n, shape=g.shape, step=0, rank=0, size=2, param=p, scale=0.5))
        per_tensor += pl.numel() * pl.element_size()
    topk.discard()
    assert got["bytes"] == payload.numel() * payload.element_size() != per_tensor
    assert got["enc"] > 0 and got["dec"] > 0


def test_a_candidate_in_its_own_warm_up_is_priced_as_it_would_send_now():
    """A candidate is timed and sized at the pipeline's step: PowerSGD before its ``warmup=`` exchanges
    sends the bucket dense, so it is sized dense; from its warm-up on, low-rank."""
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,candidates=none,powersgd:rank=1,warmup=6", _grads(3, 2), 2)
    tuner, pipe = runs[0].pipeline.auto, runs[0].pipeline
    b = pipe.buckets[0]
    grads = [torch.randn_like(p) for p in b.params]
    powersgd = tuner.auto.candidates[1]
    dense = 4.0 * sum(g.numel() for g in grads)
    assert pipe.step < 6 and tuner._time_codec(powersgd, b, grads)["bytes"] == dense
    pipe.step = 6
    matrix = 4.0 * 40 * 50  # w1, the bucket's one matrix: rank 1 sends P and Q (40 + 50 values)
    assert tuner._time_codec(powersgd, b, grads)["bytes"] == dense - matrix + 4.0 * (40 + 50)


def test_the_decision_is_taken_again_when_a_candidates_warm_up_ends(monkeypatch):
    """On a slow link PowerSGD (warmup=6) is priced dense at the first decision (step 2): nothing to
    gain, the dense exchange stays. At step 6 its warm-up ends, auto decides again (long before
    ``every``) and takes it, low-rank; every rank alike."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    learnt = []
    real = AutoTuner._calibrate

    def calibrate(self, measured, predicted, ran=None):
        learnt.append((self.pipe.step, measured))
        return real(self, measured, predicted, ran)

    monkeypatch.setattr(AutoTuner, "_calibrate", calibrate)
    spec = "auto:warmup=2,every=1000,trial=0,accuracy=relaxed,candidates=none,powersgd:rank=1,warmup=6"
    runs = run_pipeline(spec, _grads(9, 2), 2)
    for r in runs:
        decisions = [(d["step"], d["reason"].split(";")[0], d["choice"]) for d in r.pipeline.auto.decisions]
        assert decisions[0][:2] == (2, "warmup") and set(decisions[0][2]) == {"none"}
        assert [d[:2] for d in decisions[1:]] == [(6, WARMED_UP)]
        assert set(r.pipeline.auto.report()["choice"]) == {"powersgd:rank=1,warmup=6"}
    # what ran before (maybe that candidate, dense) is not learnt against its price from now on
    assert {step for step, m in learnt if m > 0} == {2} and {step for step, m in learnt if m == 0} == {6}
    got = runs[0].received  # dense until step 6; then w1 (40 x 50, the one matrix) goes as P and Q
    assert min(got[:6]) >= got[0] and max(got[6:]) < got[0] - 4 * 40 * 50 + 4 * (40 + 50) + 64


def test_only_a_warm_up_the_candidate_runs_itself_is_waited_for():
    """Under auto only PowerSGD sends dense by itself at the start (``own_warmup``); a top-k
    ``warmup=`` is the pipeline's, which auto does not run per candidate: no decision waits for it,
    nor for a candidate the guard rules out. A trial that ran past a candidate's warm-up is followed
    by a decision right after it."""
    spec = "auto:warmup=2,every=1000,trial=0,accuracy=relaxed,candidates=none,topk:ratio=0.1,warmup=4"
    runs = run_pipeline(spec, _grads(7, 2), 2)
    assert [d["reason"] for d in runs[0].pipeline.auto.decisions] == ["warmup"]
    # nor for a warm-up the accuracy guard has ruled the candidate out of (rank 1 of these gradients)
    runs = run_pipeline("auto:warmup=3,every=1000,trial=0,candidates=none,powersgd:rank=1,warmup=6", _grads(8, 2), 2)
    tuner = runs[0].pipeline.auto
    assert not any(tuner.eligible(bi, 1) for bi in range(len(runs[0].pipeline.buckets)))
    assert [d["reason"] for d in tuner.decisions] == ["warmup"]
    runs = run_pipeline("auto:warmup=2,every=1000,accuracy=relaxed,candidates=none,powersgd:rank=1,warmup=6",
                        _grads(3, 2), 2)
    tuner = runs[0].pipeline.auto
    tuner.priced_at, tuner.last_eval = 3, 8   # timed at step 3, a trial until step 8
    assert tuner._warm_up_ended(8) and not tuner._warm_up_ended(5)
    tuner.priced_at = 6
    assert not tuner._warm_up_ended(9)


def test_a_trial_across_a_candidates_warm_up_end_learns_nothing_of_that_candidate(monkeypatch):
    """PowerSGD (warmup=8) and fp16 are close in the model, so the first decision (step 2) tries both.
    PowerSGD's warm-up ends during the trial: its trial exchanges ran dense, then low-rank, against
    its dense price, so the trial calibrates fp16 alone; the decision right after prices PowerSGD
    again, as it now sends. Every rank alike."""
    model = {"none": 20e-3, "fp16": 6e-3, "powersgd": 5e-3}
    real = {"none": 20e-3, "fp16": 12e-3, "powersgd": 15e-3}
    _fake_costs(monkeypatch, model, real)
    spec = "auto:warmup=2,every=1000,accuracy=relaxed,check=1000,trial=4,candidates=none,fp16,powersgd:rank=1,warmup=8"
    runs = run_pipeline(spec, _grads(24, 2), 2)
    for r in runs:
        d = r.pipeline.auto.decisions
        trial = next(x for x in d if x["reason"] == "trial")
        assert d[0]["step"] == 2 and d[0]["reason"].startswith("warmup; trying") and trial["step"] > 8, d
        assert set(trial["calibration"]) == {"none", "fp16"}, trial
        assert trial["calibration"]["fp16"] == pytest.approx(2.0)
        after = d[d.index(trial) + 1]
        assert after["reason"].split(";")[0] == WARMED_UP and after["step"] == trial["step"] + 1, d
        assert r.pipeline.auto.calib == runs[0].pipeline.auto.calib
    # a trial that ends before the warm-up does learn PowerSGD's ratio
    runs = run_pipeline(spec.replace("warmup=8", "warmup=40"), _grads(24, 2), 2)
    trial = next(x for x in runs[0].pipeline.auto.decisions if x["reason"] == "trial")
    assert trial["calibration"]["powersgd:rank=1,warmup=40"] == pytest.approx(3.0)


@pytest.mark.parametrize("warmup,learnt", [(10, False), (13, True)])
def test_a_contender_cut_early_learns_nothing_past_its_candidates_warm_up_end(monkeypatch, warmup, learnt):
    """PowerSGD, predicted second, is cut early (step 13: its exchanges take 5x the prediction). Where
    its own warm-up ended before the last exchange measured (step 12), its exchanges ran otherwise than
    they were priced: it learns no calibration; where it ends at step 13, all of them ran dense, as
    priced, and it learns 5x."""
    model = {"none": 20e-3, "fp16": 5e-3, "powersgd": 6e-3}
    real = {"none": 20e-3, "fp16": 5e-3, "powersgd": 30e-3}
    _fake_costs(monkeypatch, model, real)
    spec = ("auto:warmup=2,every=1000,accuracy=relaxed,check=1000,trial=8,"
            f"candidates=none,fp16,powersgd:rank=1,warmup={warmup}")
    runs = run_pipeline(spec, _grads(16, 2), 2)
    for r in runs:
        trial = next(x for x in r.pipeline.auto.decisions if x["reason"] == "trial")
        assert trial["cut_early"] == [f"powersgd:rank=1,warmup={warmup}"] and trial["step"] == 13, trial
        cal = trial["calibration"]
        assert cal["fp16"] == pytest.approx(1.0)
        assert (cal.get(f"powersgd:rank=1,warmup={warmup}") == pytest.approx(5.0)) if learnt else \
            f"powersgd:rank=1,warmup={warmup}" not in cal, cal


def test_contenders_the_model_cannot_separate_are_measured(monkeypatch):
    """The model predicts top-k fastest and fp16 within 2x of it; their real exchanges are the other
    way round. auto runs each contender `trial` exchanges (the predicted fastest first), compares the
    median step periods (the ranks' mean) and keeps fp16 -- on every rank, with no re-decision after."""
    model = {"none": 20e-3, "fp16": 5e-3, "topk": 3e-3}
    real = {"none": 20e-3, "fp16": 5e-3, "topk": 9e-3}
    _fake_costs(monkeypatch, model, real)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=2,trial=4,candidates=none,fp16,topk:ratio=0.01", _grads(20, 2), 2)
    for r in runs:
        tuner = r.pipeline.auto
        d = tuner.decisions
        assert d[0]["reason"] == "warmup; trying 2 contenders" and d[0]["choice"] == ["topk:ratio=0.01"], d
        assert d[1]["reason"] == "trial" and d[1]["choice"] == ["fp16"], d
        assert d[1]["measured_period_ms"] == {"fp16": pytest.approx(10.0), "topk:ratio=0.01": pytest.approx(14.0)}
        assert list(d[1]["measured_period_ms"]) == ["topk:ratio=0.01", "fp16"] and d[1]["cut_early"] == []
        assert len(d) == 2 and tuner.report()["choice"] == ["fp16"]
        assert [x["choice"] for x in runs[0].pipeline.auto.decisions] == [x["choice"] for x in d]
    # where the contenders' periods are within the slack, the more accurate one is kept; trial=0 trusts
    # the model (top-k)
    real["topk"] = 4.8e-3
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=2,trial=4,candidates=none,fp16,topk:ratio=0.01", _grads(20, 2), 2)
    assert runs[0].pipeline.auto.report()["choice"] == ["fp16"]
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=50,trial=0,candidates=none,fp16,topk:ratio=0.01", _grads(6, 2), 2)
    assert runs[0].pipeline.auto.report()["choice"] == ["topk:ratio=0.01"]
    # several buckets: one configuration per contender over all of them, the same on every rank
    real["topk"] = 9e-3
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=2,trial=4,candidates=none,fp16,topk:ratio=0.01", _grads(20, 2), 2,
                        bucket_bytes=4000)
    assert len(runs[0].pipeline.buckets) > 1
    for r in runs:
        assert r.pipeline.auto.report()["choice"] == ["fp16"] * len(r.pipeline.buckets)
        assert r.pipeline.auto.decisions[-1]["reason"] == "trial"


@pytest.mark.parametrize("rank1_large,tries", [(40e-3, 1), (3e-3, 3)])
def test_the_link_probe_tries_the_large_allreduce_again_only_where_it_is_cheap(monkeypatch, rank1_large, tries):
    """One 1 MB allreduce is enough where it takes 10x the small one (a slow link: the transfer
    dominates, and each try costs a step); otherwise the fastest of three. The ranks' mean times
    decide, so both ranks run the same collectives although only rank 1's large try is slow."""
    import threading

    import hvd_ext.auto as auto_mod
    from hvd_ext.auto import _PROBE_LARGE

    rank_of, large_next = {}, {}   # thread -> rank; rank -> whether its next timed call is the large probe
    calls = {0: 0, 1: 0}           # large allreduces timed, per rank
    allreduce = AutoTuner._allreduce

    def tagged(self, values, name):
        rank_of[threading.get_ident()] = self.pipe.rank
        large_next[self.pipe.rank] = values.numel() == _PROBE_LARGE
        return allreduce(self, values, name)

    def best_time(run, reps):
        for _ in range(reps):
            run()
        me = rank_of[threading.get_ident()]
        if not large_next[me]:
            return 1e-3
        calls[me] += reps
        return rank1_large if me == 1 else 1e-3

    monkeypatch.setattr(auto_mod, "best_time", best_time)
    monkeypatch.setattr(AutoTuner, "_allreduce", tagged)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0,candidates=none,fp16", _grads(3, 2), 2)
    assert calls == {0: tries, 1: tries}
    assert runs[0].pipeline.auto.decisions[0]["link"] == runs[1].pipeline.auto.decisions[0]["link"]


def test_a_contender_clearly_slower_than_the_shortest_stops_early(monkeypatch):
    """Three contenders, 12 trial exchanges each in two rounds of 6 (ABC, then CBA): top-k (predicted
    fastest) runs first; none's step period, 3x top-k's, is out of reach after the settle periods and
    3 more exchanges, so it stops there (one allreduce agrees on it) and sits out the second round;
    fp16, within the slack, runs both windows and is kept (the most accurate within the slack). The
    same decisions on every rank."""
    model = {"none": 7e-3, "fp16": 5e-3, "topk": 3e-3}
    real = {"none": 20e-3, "fp16": 3.2e-3, "topk": 3e-3}
    _fake_costs(monkeypatch, model, real)
    ran, seq = {}, []
    timed = AutoTuner.exchange_time

    def count(self, seconds):
        if self._trial is not None and self.pipe.rank == 0:
            name = self.auto.candidates[self.choice[0]].name
            ran[name] = ran.get(name, 0) + 1
            if not seq or seq[-1][0] != name:
                seq.append([name, 0])
            seq[-1][1] += 1
        timed(self, seconds)

    monkeypatch.setattr(AutoTuner, "exchange_time", count)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=50,trial=12,candidates=none,fp16,topk:ratio=0.01", _grads(40, 2), 2)
    for r in runs:
        d = r.pipeline.auto.decisions
        assert d[0]["reason"] == "warmup; trying 3 contenders", d
        assert d[1]["reason"] == "trial" and d[1]["choice"] == ["fp16"], d
        assert list(d[1]["measured_period_ms"]) == ["topk:ratio=0.01", "fp16", "none"], d
        assert d[1]["cut_early"] == ["none"] and d[1]["measured_period_ms"]["none"] == pytest.approx(25.0), d
        assert r.pipeline.auto.report()["choice"] == ["fp16"]
    assert ran == {"topk": 16, "fp16": 16, "none": 5}, ran  # 2 rounds of 2 settle + 6 measured; none cut
    # the rounds interleave, the second in reverse order and without none (cut in the first)
    assert seq == [["topk", 8], ["fp16", 8], ["none", 5], ["fp16", 8], ["topk", 8]], seq
    # a contender inside the bound is not cut: with none at 1.3x top-k's period it runs its window
    real["none"] = 5.4e-3
    ran.clear()
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,check=50,trial=12,candidates=none,fp16,topk:ratio=0.01", _grads(56, 2), 2)
    assert runs[0].pipeline.auto.decisions[1]["cut_early"] == [] and ran["none"] == 16, ran


def test_drift_needs_two_checks_in_a_row():
    """The measured exchange leaving [0.5x, 2x] of the prediction once (a burst of load) is noted and
    forgotten; twice in a row it re-decides (agreed by an allreduce: every rank alike)."""
    from hvd_ext.testing.simulated import SimulatedWorld

    def body(rank, transport):
        from hvd_ext.exchange import Exchange
        from hvd_ext.pipeline import GradientPipeline
        comp = hvd_ext.compression_from_spec("auto:warmup=2,accuracy=relaxed,trial=0,candidates=none,fp16")
        named = [(n, torch.nn.Parameter(torch.zeros(*s))) for n, s in NAMES.items()]
        pipe = GradientPipeline(named, comp, comp.feedback, Exchange(transport=transport), 1 << 20, None)
        t = pipe.auto
        t.decisions.append({})
        t.predicted_s = 10e-3
        seen = []
        t.evaluate = lambda reason: seen.append(reason)
        for m in (30, 10, 30, 30, 3, 10):  # one out, back in, two out, ...
            t._measured = [m * 1e-3] * 3
            t._check_drift()
        return seen

    out = SimulatedWorld(2).run(body)
    assert out[0] == out[1] and len(out[0]) == 1 and out[0][0].startswith("measured 30.00 ms"), out


def test_an_unbiased_choice_runs_exactly_as_the_fixed_codec(monkeypatch):
    """Once auto has chosen 8-bit QSGD, its steps are the fixed codec's, bit for bit: no shared residual
    around a codec that runs without one when fixed (and nothing else of auto's in the data path)."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link(slow_from=0))
    grads = _grads(7, 2, seed=9)
    auto = run_pipeline("auto:warmup=3,trial=0,candidates=none,qsgd:bits=8,route=allgather", grads, 2)
    fixed = run_pipeline("qsgd:bits=8,route=allgather", grads, 2)
    assert set(auto[0].pipeline.auto.report()["choice"]) == {"qsgd:bits=8,route=allgather"}
    for step in range(3, 7):
        for n in NAMES:
            for a, f in zip(auto, fixed):
                assert torch.equal(a.results[step][n], f.results[step][n]), (step, n)
    assert not auto[0].pipeline.feedback.memory


def test_under_adam_the_second_moment_stays_live_and_memory_codecs_are_left_out():
    """auto does not freeze Adam's second moment (a moment frozen at its first value lost 0.7 nats per
    byte on the lm loop); instead, with it live, codecs with an error-feedback memory are not eligible.
    variance=freeze in the spec restores both."""
    from hvd_ext.variance_freeze import VarianceFreeze

    net = torch.nn.Linear(4, 2)
    names = {p: n for n, p in net.named_parameters()}
    spec = "auto:candidates=none,fp16,qsgd:bits=8,topk:ratio=0.03"
    for opt, frozen in ((torch.optim.Adam(net.parameters()), False), (torch.optim.SGD(net.parameters(), lr=0.1), False)):
        comp = hvd_ext.compression_from_spec(spec)
        comp.bind_optimizer(opt)
        assert (VarianceFreeze.for_optimizer(opt, comp, names) is not None) == frozen
        adam = isinstance(opt, torch.optim.Adam)
        assert [comp.allowed(i) for i in range(4)] == [True, True, True, not adam]
        assert comp.memory == [False, False, False, True]
    comp = hvd_ext.compression_from_spec("auto:variance=freeze,candidates=none,fp16,qsgd:bits=8,topk:ratio=0.03")
    opt = torch.optim.Adam(net.parameters())
    comp.bind_optimizer(opt)
    assert all(comp.allowed(i) for i in range(4))
    assert VarianceFreeze.for_optimizer(opt, comp, names) is not None


@pytest.mark.parametrize("codec", ["efsignsgd", "onebit", "randomk:ratio=0.1", "signum", "signsgd"])
def test_a_codec_that_compresses_the_momentum_is_left_out_under_momentum_sgd(codec):
    """efsignsgd, onebit and randomk compress SGD's momentum in their own residual (compress_momentum);
    signum and signSGD take it over. auto's candidates share one residual and one optimizer: neither is
    reconfigured for one of them (the optimizer keeps its momentum for every other candidate), and that
    codec is not eligible while the optimizer has momentum -- whatever order the candidates come in."""
    net = torch.nn.Linear(4, 2)
    for momentum in (0.9, 0.0):
        other = "signsgd" if codec == "signum" else "signum"
        for spec in (f"auto:candidates=none,fp16,{codec},{other}", f"auto:candidates=none,{other},fp16,{codec}"):
            comp = hvd_ext.compression_from_spec(spec)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=momentum)
            comp.bind_optimizer(opt)
            assert opt.param_groups[0]["momentum"] == momentum
            assert comp.feedback.velocity == "local" and not comp.feedback.momentum
            for i, s in enumerate(comp.candidate_specs):
                assert comp.allowed(i) == (s in ("none", "fp16") or momentum == 0.0), (spec, s)


def test_no_eligible_candidate_is_refused_at_construction():
    net = torch.nn.Linear(4, 2)
    comp = hvd_ext.compression_from_spec("auto:candidates=efsignsgd,signum")
    with pytest.raises(ValueError, match="no candidate can run under SGD.*accepted"):
        comp.bind_optimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def test_calibration_file_gives_auto_its_link(tmp_path, monkeypatch):
    """HVD_EXT_CALIBRATION (python -m hvd_ext.plan --measure): auto takes the flat link from the file
    instead of probing, so a slow link there makes it compress where the probe alone would not."""
    import json

    from hvd_ext.exchange import calibration

    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"version": 1, "ranks": 2, "nodes": 1, "local": 2, "device": "cpu",
                                "links": {"flat": {"lat": 1e-5, "bandwidth": 1e5}}}))
    monkeypatch.setenv(calibration.ENV, str(path))
    monkeypatch.setattr(calibration, "_CACHE", {})
    monkeypatch.setattr(AutoTuner, "_probe_link", AutoTuner._probe_link)  # the real probe: it reads the file
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed", _grads(3, 2), 2)
    for r in runs:
        d = r.pipeline.auto.decisions[0]
        assert d["link"]["MB_per_s"] == pytest.approx(0.1, rel=0.05)
        assert set(r.pipeline.auto.report()["choice"]) != {"none"}


def test_auto_prices_a_routes_overhead_as_the_calibration_file_timed_it(tmp_path, monkeypatch):
    """A candidate's route costs its host work beyond the codec's passes where the calibration file
    timed this world (``route_overhead_s``, as the planner adds it); in another world, nothing."""
    import json

    from hvd_ext.exchange import calibration
    from hvd_ext.exchange.bucket_cost import Network

    c = hvd_ext.compression_from_spec("topk:ratio=0.01")
    shapes = [(64, 100), (100,)]
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"version": 1, "ranks": 2, "nodes": 1, "local": 2, "codec": {"topk": 1e8},
                                "route_overhead_s": {"topk": {"sparse_rs": [2e-3, 1e-4, 1e-8]}}}))
    monkeypatch.setattr(calibration, "_CACHE", {})

    def priced(size, route):
        exchange = type("E", (), {"topology": lambda self: None})()  # one node's ranks, no topology known
        tuner = type("T", (), {"pipe": type("P", (), {"size": size, "step": 10, "exchange": exchange})(),
                               "network": Network.one_link(size, 1e-4, 1e8)})()
        return AutoTuner.predict(tuner, c, route, shapes, 1e3, 1e-4, 1e-4, "cpu")

    before = {(n, r): priced(n, r) for n in (2, 4) for r in ("sparse_rs", "allgather")}
    monkeypatch.setenv(calibration.ENV, str(path))
    assert priced(2, "sparse_rs") - before[2, "sparse_rs"] == pytest.approx(2e-3 + 2 * 1e-4 + 6500 * 1e-8)
    assert priced(2, "allgather") == before[2, "allgather"]  # a route the file did not time
    assert priced(4, "sparse_rs") == before[4, "sparse_rs"]  # another world


def test_a_codecs_allreduce_rounds_are_priced(monkeypatch):
    """auto prices each allreduce round as a collective, as the planner does: PowerSGD's bucket with a
    matrix takes two rounds (P, then Q), a dense candidate one; one round's latency each."""
    monkeypatch.setattr(AutoTuner, "_probe_link", _link())
    seen = {}
    terms = pricing.flat_terms

    def recording(comp, shapes, route, *args, **kw):
        out = terms(comp, shapes, route, *args, **kw)
        seen.setdefault(route, set()).add(out["rounds"])
        return out

    monkeypatch.setattr(pricing, "flat_terms", recording)
    run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0,candidates=none,powersgd:warmup=0", _grads(3, 2), 2)
    assert seen == {"allreduce": {1, 2}}
    tuner = type("T", (), {"pipe": type("P", (), {"size": 2})(), "link": {"lat": 1e-3, "bw": 1e6}})()
    net = AutoTuner.probe_network(tuner)
    one, two = (flat_cost("allreduce", 100, 400.0, 0.0, 0.0, net, rounds=r).seconds for r in (1, 2))
    assert two - one == pytest.approx(1e-3)
    assert one == pytest.approx(1e-3 + cost.allreduce_wire(400.0, 2) / 1e6)


def test_assumed_node_links_move_what_the_probe_measured(monkeypatch):
    """Across nodes whose links were not measured (the cost model's defaults: 10 Gbit/s between the
    nodes), auto prices the link between the nodes at the bandwidth its own probe measured, so a slow
    link makes it compress as on one node; the decision log says what it priced on."""
    def probe(self):
        wire = cost.allreduce_wire(4.0 * 256 * 1024, self.pipe.size)
        return {"lat": 1e-5, "large": 1e-5 + wire / 1e6, "wire": wire}  # 1 MB/s

    monkeypatch.setattr(AutoTuner, "_probe_link", probe)
    runs = run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0", _grads(3, 4), 4, ranks_per_node=2)
    for r in runs:
        assert r.exchange.node_links_assumed
        d = r.pipeline.auto.decisions[0]
        assert d["network"]["nodes"] == 2 and d["network"]["MB_per_s"] == pytest.approx(1.0, rel=1e-3)
        assert "none" not in r.pipeline.auto.report()["choice"]


def test_one_rank_decides_with_nothing_on_the_wire(monkeypatch):
    """A one-rank world (an elastic job down to one worker): the probe moves no bytes, so it measures
    no bandwidth; auto still decides (nothing on the wire costs nothing) and keeps every bucket whole."""
    def probe(self):
        return {"lat": 1e-5, "large": 2e-5, "wire": cost.allreduce_wire(4.0 * 256 * 1024, self.pipe.size)}

    monkeypatch.setattr(AutoTuner, "_probe_link", probe)
    grads = _grads(4, 1)
    r = run_pipeline("auto:warmup=2,accuracy=relaxed,trial=0", grads, 1)[0]
    assert r.pipeline.auto.decisions and r.pipeline.auto.link["bw"] == 0.0
    for step in range(4):
        for n in NAMES:
            torch.testing.assert_close(r.results[step][n], grads[step][0][n])
