"""Where a volume goes and what it may be: the scheduler, quotas, volume types, GiB promised to growing
volumes, and placement advice with its RTT model."""
