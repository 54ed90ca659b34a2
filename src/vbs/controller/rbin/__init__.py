"""The Recycle Bin's own API (service ``rbin``, docs/recycle-bin.md): rest-json routes on the controller's
endpoint and their errors."""
