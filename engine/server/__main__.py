import sys

from engine.server.serve import main

sys.exit(main())
