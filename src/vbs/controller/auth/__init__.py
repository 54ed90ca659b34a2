"""Who may call the controller and with what keys: the authenticator (bearer or SigV4), the access
key store with its master key, and encrypted volumes' data keys sealed with that master key."""
