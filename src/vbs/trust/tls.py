"""TLS for the HTTP APIs: what uvicorn serves with, and what a client verifies against.

Agents require a client certificate from the install's CA (only the controller calls them: mutual
TLS). The controller's port also serves users, who have no certificates, so it asks for one and
verifies any that is presented; agents prove who they are with their node token (vbs.trust.node_credentials).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbs.errors import InvalidParameter


@dataclass(frozen=True)
class TlsFiles:
    cert: Path | None
    key: Path | None
    ca: Path | None

    @classmethod
    def of(cls, cfg: Any) -> TlsFiles | None:
        """The TLS files of a service section, None if it has none, an error if half of them."""
        cert, key, ca = cfg.tls_cert, cfg.tls_key, cfg.tls_ca
        if cert is None and key is None and ca is None:
            return None
        if (cert is None) != (key is None):
            raise InvalidParameter("set both tls_cert and tls_key (--tls-cert/--tls-key), or neither")
        for p in (cert, key, ca):
            if p is not None and not Path(p).is_file():
                raise InvalidParameter(f"TLS file {p} does not exist")
        return cls(cert, key, ca)

    @property
    def serves(self) -> bool:
        return self.cert is not None and self.key is not None

    def server_kwargs(self, *, require_client_cert: bool) -> dict[str, Any]:
        """uvicorn.Config keyword arguments for serving HTTPS."""
        if not self.serves:
            return {}
        out: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.ca is not None:
            out["ssl_ca_certs"] = str(self.ca)
            out["ssl_cert_reqs"] = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
        return out

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts the CA (or the system's) and presents our certificate."""
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None and self.key is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def client_verify(ca_bundle: str | None, *, https: bool = True) -> ssl.SSLContext | bool:
    """For the CLI: verify against ``ca_bundle`` when given, else the system's trust store.

    A client whose URLs are all plain http (``https=False``) makes no TLS connection: it gets a
    context that verifies but trusts no CA (any TLS connection would fail), because loading the
    trust store costs every command tens of milliseconds."""
    if ca_bundle:
        if not Path(ca_bundle).is_file():
            raise InvalidParameter(f"CA bundle {ca_bundle} does not exist")
        return ssl.create_default_context(cafile=ca_bundle)
    if not https:
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    return True
