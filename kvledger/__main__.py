"""`python -m kvledger`: the `kvledger` command."""

import sys

from kvledger.cli import main

sys.exit(main())
