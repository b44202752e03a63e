"""`python -m jax_routeweaver.cli ...`: the `routeweaver` command without its console script."""

import sys

from jax_routeweaver.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
