import sys

from kda_backend.cli import main

sys.exit(main())
