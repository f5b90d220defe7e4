"""The model zoo, re-exported for artifact export: it lives with the torch backend
(``edge_client/trainers/zoo.py``), which devices import without this package."""

from edge_client.trainers.zoo import DEFAULT_INPUT, MODELS, build_module, register_model

__all__ = ["MODELS", "DEFAULT_INPUT", "build_module", "register_model"]
