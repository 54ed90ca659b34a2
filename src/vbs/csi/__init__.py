"""The Container Storage Interface driver (``vbs csi``, docs/kubernetes.md): Identity, Controller and Node
services on a unix socket, a client of the controller's REST API (docs/rest-api.md) with a user's access key.

Modules: ``proto`` (the generated modules of the CSI spec, loaded lazily), ``errors`` (VBS errors as gRPC
codes), ``requests`` (what a CSI request asks, checked: sizes, parameters, capabilities), ``vbs_api`` (the
calls to the controller), ``identity``, ``controller``, ``node`` (the services), ``node_devices`` (loop
devices, filesystems and mounts on a node), ``server`` (the gRPC server).
"""
