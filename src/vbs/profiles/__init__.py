"""Command profiles (the paper's (docs/architecture.md §1) command line extraction): TOML files of argv templates
with typed
placeholders, loaded and checked by ``engine``; the ones VBS ships live in a folder per kind
(``hypervisor/``, ``backend/``, ``resolver/``)."""

from vbs.profiles.engine import (
    DEFAULT_PROFILE_DIR,
    PROFILE_NAME_RE,
    CommandFailed,
    CommandOutput,
    CommandSchema,
    CommandSpec,
    Profile,
    ProfileError,
    ProfileSchema,
    load_profile,
    shipped_profiles,
)
from vbs.profiles.placeholders import LIBRARY, Placeholder

__all__ = [
    "DEFAULT_PROFILE_DIR",
    "PROFILE_NAME_RE",
    "CommandFailed",
    "CommandOutput",
    "CommandSchema",
    "CommandSpec",
    "Profile",
    "ProfileError",
    "ProfileSchema",
    "load_profile",
    "shipped_profiles",
    "LIBRARY",
    "Placeholder",
]
