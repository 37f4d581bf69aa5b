"""``python -m kubeps.runtime.server``: run this task's ps or worker server from ``TF_CONFIG`` until terminated."""

import sys

from kubeps.runtime.server.service import main

sys.exit(main())
