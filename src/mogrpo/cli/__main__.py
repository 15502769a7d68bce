"""`python -m mogrpo.cli` (as torchrun launches it) is the `mogrpo` command."""

import sys

from mogrpo.cli.app import main

sys.exit(main())
