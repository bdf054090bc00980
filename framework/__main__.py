"""``python -m tokenmill``: the ``tokenmill`` command."""

import sys

import tokenmill

if tokenmill.__file__ is None:
    sys.exit(
        f"error: Python imported {', '.join(tokenmill.__path__)} as the package 'tokenmill' "
        "(a folder without __init__.py, such as a checkout named tokenmill in the current "
        "directory), not the installed tokenmill; run from another directory or use the "
        "`tokenmill` command"
    )

from tokenmill.cli import main  # noqa: E402

sys.exit(main())
