import sys

from kvledger.engine.server.serve import main

sys.exit(main())
