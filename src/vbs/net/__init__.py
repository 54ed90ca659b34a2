"""Networking and HTTP plumbing the three services share: the bounded ASGI servers and their error
mapping (web), the JSON client (api_client), service URL lists, free ports, heartbeats,
Prometheus plumbing and the TLS tunnel around iSCSI (stunnel)."""
