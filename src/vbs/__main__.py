"""``python -m vbs`` is the ``vbs`` executable."""

from vbs.cli.main import main

main()
