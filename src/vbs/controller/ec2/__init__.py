"""Amazon EC2 Query API edge: SigV4 request verification (``sigv4``) and Query-protocol parameters (``query``).

Both modules are pure (no web framework); the controller's ``POST /`` handler wires them to the volume services.
"""
