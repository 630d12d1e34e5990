"""Moved to `jaxpar.parallel.pipeline.schedules`; this name is the same module (plain Python)."""

import sys

from jaxpar.parallel.pipeline import schedules as _schedules

sys.modules[__name__] = _schedules
