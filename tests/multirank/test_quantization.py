"""Quantization and low-rank codecs through Horovod on 2 ranks: sign vote, PowerSGD, qdist."""


def test_two_ranks_vote_powersgd_qdist(run_ranks):
    res = run_ranks("sign_vote.py", np=2)
    for r in res:
        assert r["vote"] == [1.0, 0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0]
        assert r["vote_bytes"] == 13  # exchange header 12 + 1 byte of signs (a frame's last payload is not padded)
        assert r["psgd_err"] < 1e-4 and r["psgd_vec_err"] == 0.0 and r["psgd_agree"] and r["psgd_has_q"]
        assert r["psgd_mem_sum"] < 1e-4
        assert r["qdist_agree"] == [True, True] and r["qdist_params_agree"]
        assert set(r["qdist_bits"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
