"""``python -m kvblock`` is the ``kvblock`` command."""

from kvblock.cli.main import main

main()
