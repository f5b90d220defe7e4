"""Configuration: one frozen dataclass per TOML table, one module per part it configures.

Precedence, lowest first: dataclass defaults, the role's TOML table, environment
variables ``SAFL_<ROLE>_<KEY>``, then explicit overrides (CLI flags).  Unknown
keys and wrong types are refused with a :class:`ConfigError` naming the key;
range checks live in each config's ``__post_init__`` (``loading.py`` has the helpers).
"""

from .broker import BrokerConfig
from .device import DeviceConfig, TrainingSettings
from .inference import InferenceConfig
from .loading import check_id, check_range, from_mapping, load_config, read_toml, toml_text
from .model import ModelConfig
from .service import ServiceConfig
from .sources import SOURCE_KINDS, VIDEO_SUFFIXES, PreprocessSettings, SourceConfig

__all__ = ["load_config", "read_toml", "from_mapping", "check_range", "check_id", "toml_text",
           "DeviceConfig", "TrainingSettings", "SourceConfig", "PreprocessSettings",
           "SOURCE_KINDS", "VIDEO_SUFFIXES", "BrokerConfig", "ModelConfig", "ServiceConfig",
           "InferenceConfig"]
