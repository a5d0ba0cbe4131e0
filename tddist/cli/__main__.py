"""``python -m tddist.cli``: the ``tddist`` command."""

import sys

from . import main

sys.exit(main())
