"""``python -m fastload.doctor``: the same report as ``fastload doctor``."""
import sys

from . import main

sys.exit(main())
