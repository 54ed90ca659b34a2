"""The ``vbs`` command line: the paper's commands against a controller, and the service commands."""
