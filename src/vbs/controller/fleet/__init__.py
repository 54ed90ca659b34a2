"""The nodes the controller drives: their heartbeats and descriptions, the typed clients of their agent
APIs, and the reconciler that makes the real world agree with the DB."""
