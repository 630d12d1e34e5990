"""`python -m jaxpar.plan`: `jaxpar.plan.command.main`."""

import sys

from jaxpar.plan.command import main

sys.exit(main())
