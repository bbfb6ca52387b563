"""Allow ``python -m picker``."""

import sys

from picker.cli import main

sys.exit(main())
