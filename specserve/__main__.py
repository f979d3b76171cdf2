"""`python -m specserve ...` is the `specserve` command."""

import sys

from specserve.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
