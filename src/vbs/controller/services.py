"""What workflow steps and reconciliation use: the configuration, the metadata DB and the agents."""

from __future__ import annotations

from dataclasses import dataclass

from vbs.config import ControllerConfig
from vbs.controller.auth.keys import MasterKey
from vbs.controller.db import Database
from vbs.controller.fleet.agents import AgentDirectory


@dataclass
class Services:
    cfg: ControllerConfig
    db: Database
    agents: AgentDirectory
    # Seals access keys' secrets and volumes' data keys (vbs.controller.auth.encryption).
    master_key: MasterKey
