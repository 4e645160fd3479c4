"""``python -m trainbridge`` runs the ``trainbridge`` command (see ``trainbridge.cli``)."""

import os
import sys

if sys.path and sys.path[0] == os.getcwd() and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]  # python -m put the working directory first; cli adds it (last) only where a config needs it

from trainbridge.cli import main

sys.exit(main())
