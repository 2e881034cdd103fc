"""Shared set-up of the Python SDK's tests: the daemon fixture (tests/integration/kvcompd_fixture.py)
is importable from every test module, which then takes the built kvcompd from built_kvcompd()."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
