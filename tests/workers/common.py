"""Helpers for worker scripts launched by the tests."""
import json
import sys


def emit(**kw):
    """Print one RESULT line that tests.conftest.launch collects."""
    print("RESULT " + json.dumps(kw), flush=True)
    sys.stdout.flush()
