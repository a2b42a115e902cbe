"""hvd_ext.stats: CommStats.record_totals records a step from an exchange's running counters."""
from hvd_ext.stats import CommStats

def test_record_totals_records_what_the_counters_grew_by():
    s = CommStats()
    s.record_totals(bytes_sent=100, bytes_received=80, comm_wait_s=0.5, compress_s=0.1, skipped=False)
    s.record_totals(bytes_sent=250, bytes_received=80, comm_wait_s=0.75, compress_s=0.1, skipped=True)
    a, b = s.history
    assert (a["bytes_sent"], b["bytes_sent"], b["bytes_received"]) == (100, 150, 0)
    assert abs(b["comm_wait_s"] - 0.25) < 1e-12 and b["skipped"] and s.skipped_steps == 1
    assert s.bytes_sent == 250  # the totals match the counters
