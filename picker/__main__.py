"""Allow ``python -m kv_picker``."""

import sys

from kv_picker.cli import main

sys.exit(main())
