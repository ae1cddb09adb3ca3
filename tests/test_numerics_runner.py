"""#70: `make test-numerics` proves it shook something: a run whose marked tests all skip, or
that collects none, is a failure of its own, said so, not "0 passed, 0 failed" and green."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packaging"))
import numerics  # noqa: E402


def test_a_run_that_ran_no_marked_test_fails(capsys):
    passed, failed = numerics.run_tests("nothing", {}, ["-k", "no_test_is_named_like_this"])
    assert (passed, failed) == (0, 1)
    assert "nothing: ran no numerics test (pytest's exit 5): counted as a failure" in capsys.readouterr().out
