"""The test side of the workers' named checks (tests/multirank/workers/common.py, ``Checks``).

Each rank's RESULT object carries ``{"checks": {name: {"ok": bool, "detail": str}}}``;
``assert_checks`` fails with the name, rank and detail of every failed check. A check named
``"<section>: <what>"`` is under ``section`` (``assert_checks(results, section="average_none")``)."""
from __future__ import annotations


def failed_checks(results, section: str | None = None):
    """``(rank, name, detail)`` of every failed check (only names under ``section``, if given)."""
    bad = []
    for i, r in enumerate(results):
        for name, c in sorted(r.get("checks", {}).items()):
            if section is not None and not _under(name, section):
                continue
            if not c["ok"]:
                bad.append((r.get("rank", i), name, c.get("detail", "")))
    return bad


def _under(name, section):
    return name == section or name.startswith(section + ":")


def assert_checks(results, section: str | None = None):
    """Fail naming every failed check of every rank; and fail if a rank ran no check (of ``section``),
    so a check that silently stopped running does not pass."""
    assert results, "no RESULT from any rank"
    for i, r in enumerate(results):
        names = [n for n in r.get("checks", {}) if section is None or _under(n, section)]
        assert names, f"rank {r.get('rank', i)} reported no checks" + (f" under {section!r}" if section else "")
    bad = failed_checks(results, section)
    if bad:
        lines = [f"  rank {rank}: {name}" + (f" -- {detail}" if detail else "") for rank, name, detail in bad]
        raise AssertionError(f"{len(bad)} failed check(s):\n" + "\n".join(lines))
