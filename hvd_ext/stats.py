"""Per-step communication metrics (``optimizer.stats``) and an optional JSON-lines log."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional


class CommStats:
    """Per step: bytes this rank sent / received (exact payload bytes counted in the
    exchange), seconds waiting on collectives, seconds compressing, skipped or not.

    ``history`` keeps one dict per step; ``summary()`` gives totals and means.
    With ``log_path`` every step is also appended to that file as one JSON line.
    """

    def __init__(self, log_path: Optional[str] = None, keep_history: bool = True):
        self.log_path = log_path
        self.keep_history = keep_history
        self.history: List[Dict[str, Any]] = []
        self.steps = 0
        self.skipped_steps = 0
        self.exchanges = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.comm_wait_s = 0.0
        self.compress_s = 0.0
        self.extra: Dict[str, Any] = {}
        self._log = None
        self._totals = (0, 0, 0.0, 0.0)  # the exchange's running counters at the last record_totals

    def record_totals(self, *, bytes_sent: int, bytes_received: int, comm_wait_s: float, compress_s: float,
                      skipped: bool, exchanged: bool = True) -> Dict[str, Any]:
        """Record a step from running counters (an exchange's totals): the step is what they grew by."""
        now = (bytes_sent, bytes_received, comm_wait_s, compress_s)
        last, self._totals = self._totals, now
        return self.record(bytes_sent=now[0] - last[0], bytes_received=now[1] - last[1], comm_wait_s=now[2] - last[2],
                           compress_s=now[3] - last[3], skipped=skipped, exchanged=exchanged)

    def record(self, *, bytes_sent: int, bytes_received: int, comm_wait_s: float, compress_s: float,
               skipped: bool, exchanged: bool = True, **extra) -> Dict[str, Any]:
        self.steps += 1
        self.skipped_steps += int(skipped)
        self.exchanges += int(exchanged)
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received
        self.comm_wait_s += comm_wait_s
        self.compress_s += compress_s
        row = {"step": self.steps, "bytes_sent": bytes_sent, "bytes_received": bytes_received,
               "comm_wait_s": comm_wait_s, "compress_s": compress_s, "skipped": skipped,
               "exchanged": exchanged, **extra}
        if self.keep_history:
            self.history.append(row)
        if self.log_path:
            if self._log is None:
                self._log = open(self.log_path, "a")
            self._log.write(json.dumps(row) + "\n")
            self._log.flush()
        return row

    @property
    def last(self) -> Optional[Dict[str, Any]]:
        return self.history[-1] if self.history else None

    def summary(self) -> Dict[str, Any]:
        n = max(self.steps, 1)
        return {"steps": self.steps, "skipped_steps": self.skipped_steps, "exchanges": self.exchanges,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "bytes_sent_per_step": self.bytes_sent / n, "bytes_received_per_step": self.bytes_received / n,
                "comm_wait_ms_per_step": 1e3 * self.comm_wait_s / n,
                "compress_ms_per_step": 1e3 * self.compress_s / n, **self.extra}

    def reset(self) -> None:
        log = self.log_path
        self.__init__(log, self.keep_history)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
