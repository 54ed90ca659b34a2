"""What workflow steps and reconciliation use: the configuration, the metadata DB and the agents."""

from __future__ import annotations

from dataclasses import dataclass

from vbs.config import ControllerConfig
from vbs.controller.agents import AgentDirectory
from vbs.controller.db import Database
from vbs.controller.keys import MasterKey


@dataclass
class Services:
    cfg: ControllerConfig
    db: Database
    agents: AgentDirectory
    # Seals access keys' secrets and volumes' data keys (vbs.controller.encryption).
    master_key: MasterKey
