"""QEMU's X.509 credentials: a directory of fixed file names made from a service's own TLS files.

QEMU's ``tls-creds-x509`` object reads ``ca-cert.pem`` and ``server-cert.pem``/``server-key.pem``
(or ``client-…``) from one directory. A service's certificate, key and CA (``tls_cert``,
``tls_key``, ``tls_ca`` of its config section) are copied there, into a private directory (0700,
files 0600), whenever the service starts: a renewed certificate is picked up by a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vbs.errors import InvalidParameter
from vbs.system.files import write_private

__all__ = ["X509Files", "qemu_x509_dir"]


@dataclass(frozen=True)
class X509Files:
    """A service's certificate, its key and the CA its peers' certificates chain to."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_config(cls, cert: Path | None, key: Path | None, ca: Path | None) -> X509Files | None:
        """The three files, None if none is set; ``InvalidParameter`` if only some are."""
        given = [p for p in (cert, key, ca) if p is not None]
        if not given:
            return None
        if cert is None or key is None or ca is None:
            raise InvalidParameter("tls_cert, tls_key and tls_ca go together: set all three")
        return cls(cert, key, ca)


def qemu_x509_dir(files: X509Files, directory: Path, endpoint: Literal["server", "client"]) -> Path:
    """Write ``directory`` as QEMU's ``tls-creds-x509`` wants it for ``endpoint``; returns it."""
    try:
        texts = {"ca-cert.pem": files.ca.read_text(), f"{endpoint}-cert.pem": files.cert.read_text(),
                 f"{endpoint}-key.pem": files.key.read_text()}
    except OSError as exc:
        raise InvalidParameter(f"cannot read a TLS file: {exc}") from exc
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    for name, text in texts.items():
        write_private(directory / name, text)
    return directory
