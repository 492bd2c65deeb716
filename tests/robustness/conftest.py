"""Hypothesis profiles for the fuzz tests: ``ci`` (default: few examples, derandomized, no
example database written) and ``thorough`` (``INFER_FUZZ_PROFILE=thorough``: many, random)."""

import os
from typing import Any

from hypothesis import HealthCheck, Phase, settings

_COMMON: dict[str, Any] = {
    "deadline": None,  # the fake engine runs in another thread: wall time is noise
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
# No shrinking in CI: a known defect (an xfail) would spend minutes minimizing its example.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
settings.register_profile("ci", max_examples=40, derandomize=True, phases=_NO_SHRINK, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("INFER_FUZZ_PROFILE", "ci"))
