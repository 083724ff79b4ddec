"""``python -m envoykit.cli``: the ``envoykit`` command, under the guard engines need."""

import sys

from envoykit.cli import main

if __name__ == "__main__":
    sys.exit(main())
