"""Moved to `jaxpar.parallel.pipeline.timeline`; this name is the same module (plain Python)."""

import sys

from jaxpar.parallel.pipeline import timeline as _timeline

sys.modules[__name__] = _timeline
