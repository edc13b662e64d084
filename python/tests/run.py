"""Runs one pytest file of zoffload's Python suite for meson; exit 77 (skipped) without torch or pytest."""
import os
import sys

if os.environ.get("ZOFFLOAD_PY_SKIP"):
    print("skipped: " + os.environ["ZOFFLOAD_PY_SKIP"])
    sys.exit(77)
try:
    import pytest
    import torch  # noqa: F401
except ImportError as e:
    what = f"{sys.executable} cannot import {e.name}"
    if os.environ.get("ZOFFLOAD_PY_REQUIRE"):
        # -Dpython_require=true: an interpreter named for the tests must run them.
        print(f"failed: {what} (-Dpython_require=true)")
        sys.exit(1)
    print(f"skipped: {what} (install python3-torch and python3-pytest, or point "
          "-Dpython_interpreters at an interpreter that has them)")
    sys.exit(77)


class Outcomes:
    """Counts what ran: a file whose every test was skipped (what this torch lacks) is
    reported to meson as skipped, not as passed."""
    ran = skipped = 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if report.skipped:
                self.skipped += 1
            else:
                self.ran += 1

    def pytest_collectreport(self, report):
        if report.skipped:
            self.skipped += 1


outcomes = Outcomes()
# -p no:cacheprovider: nothing written into the source tree.
status = pytest.main(["-q", "-p", "no:cacheprovider", "-W", "error::pytest.PytestUnraisableExceptionWarning",
                      *sys.argv[1:]], plugins=[outcomes])
if status in (0, 5) and outcomes.ran == 0 and outcomes.skipped > 0:
    sys.exit(77)
sys.exit(status)
