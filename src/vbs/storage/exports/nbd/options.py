"""The NBD driver's settings as the agent's config gives them: the TLS mode over TCP, and
``[storage_agent.options.nbd]``."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vbs.config import StorageAgentConfig
from vbs.errors import InvalidParameter
from vbs.qemu.tls import X509Files
from vbs.wire.qos import QoS

from .daemon import TlsMode

log = logging.getLogger("vbs.storage.exports.nbd.driver")  # said at every start, under the driver's name


def tls_of(cfg: StorageAgentConfig, x509: X509Files | None) -> TlsMode:
    """``nbd_tls``, or ``off`` where ``insecure`` allows plain TCP (said at every start)."""
    tls: TlsMode = cfg.nbd_tls
    if cfg.nbd_socket_dir is None and tls == "x509" and x509 is None:
        if not cfg.insecure:
            raise InvalidParameter(
                "NBD over TCP needs TLS: set tls_cert, tls_key and tls_ca of [storage_agent] (X.509, the "
                "default), or nbd_tls = \"psk\", or nbd_socket_dir (hypervisor on this machine), or run "
                "--insecure")
        tls = "off"
    if cfg.nbd_socket_dir is None and tls == "off":
        if not cfg.insecure:
            raise InvalidParameter("nbd_tls = \"off\" (plain NBD over TCP) is allowed only with --insecure")
        log.warning("INSECURE: NBD exports are served over plain TCP on %s:%d: anyone who reaches that "
                    "address can list, read and write every export", cfg.export_host, cfg.nbd_port)
    return tls


class NbdOptions(BaseModel):
    """``[storage_agent.options.nbd]``: the daemon's I/O mode and the point-in-time copy rate."""

    model_config = ConfigDict(extra="forbid")

    aio: Literal["native", "threads", "io_uring"] = "native"
    cache_direct: bool = True
    copy_speed: int = Field(0, ge=0)
    # [storage_agent.options.nbd.fair_share.gp3] iops = …, mbps = …: what this node's gp3 volumes share.
    fair_share: dict[str, QoS] = Field(default_factory=dict, max_length=16)
