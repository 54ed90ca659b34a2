"""Data Lifecycle Manager (docs/lifecycle-policies.md): snapshot policies (the ``dlm`` API, the REST routes
and the CLI) and the controllers' scheduler that runs them."""
