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

__version__ = "0.1.0"
