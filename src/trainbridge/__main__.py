"""``python -m trainbridge`` runs the ``trainbridge`` command (see ``trainbridge.cli``)."""

import sys

from trainbridge.cli import main

sys.exit(main())
