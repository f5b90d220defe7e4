"""safl-edge device runtime: streaming buffer, SAFL, trainers and the device role.

Importing this package loads numpy only: no torch, no aggregator.
"""

from .buffer import StreamBuffer
from .config import DeviceConfig
from .device import Device
from .errors import ConfigError, MessageError, SaflError, SelectionError, ShapeError
from .safl import acceptance_probability, annealed_merge, performance_gap, upload_probability

__all__ = [
    "StreamBuffer",
    "DeviceConfig",
    "Device",
    "SaflError",
    "ConfigError",
    "MessageError",
    "SelectionError",
    "ShapeError",
    "acceptance_probability",
    "annealed_merge",
    "performance_gap",
    "upload_probability",
]


def __getattr__(name: str) -> str:
    # The installed distribution's version (pyproject.toml is the one place it is written),
    # read when asked rather than at every import.
    if name == "__version__":
        from .cli import version
        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
