"""The ``vbs`` command line: the paper's (docs/architecture.md §1) commands against a controller, and the service
commands."""
