"""The one exception hierarchy of safl-edge.

Every error a caller can act on derives from :class:`SaflError`; each carries
an exit code so the CLI can map it without a lookup table.
"""

from __future__ import annotations

__all__ = [
    "SaflError",
    "ConfigError",
    "MessageError",
    "SelectionError",
    "ShapeError",
    "ArtifactError",
    "SourceError",
    "ConnectError",
    "BrokerRefused",
    "RoleStalled",
]


class SaflError(Exception):
    """Base class of every safl-edge error."""

    exit_code = 1


class ConfigError(SaflError, ValueError):
    """A configuration value is missing, of the wrong type or out of range.

    The message always names the offending key.
    """

    exit_code = 2

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key, self.problem = key, problem


class MessageError(SaflError, ValueError):
    """A message was rejected; ``reason`` is the short counter name."""

    exit_code = 3

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"rejected message ({reason}): {detail}")
        self.reason = reason


class SelectionError(SaflError, ValueError):
    """A client-selection problem cannot be solved as posed."""


class ShapeError(SaflError, ValueError):
    """An array does not have the shape or dtype the model layout requires."""


class ArtifactError(SaflError):
    """Training artifacts are missing, corrupt, or laid out unlike the federation's model."""

    exit_code = 4


class SourceError(SaflError):
    """A sample source (camera, video, replay folder, label sidecar) cannot deliver."""

    exit_code = 5


class ConnectError(SaflError):
    """The broker could not be reached within the connect timeout."""

    exit_code = 6


class BrokerRefused(SaflError):
    """The broker answered but refused us (credentials, ACL, protocol)."""

    exit_code = 7


class RoleStalled(SaflError):
    """The role's own work (its start, its ticks, its parent's models) failed on every try
    for longer than it can wait: the federation cannot go on through it, so it ends."""

    exit_code = 9
