"""What a message's fields may hold: ids, product names, integers a JSON decoder keeps
exact, and 1-D finite arrays frozen on construction.  Every check raises
:class:`~edge_client.errors.MessageError` with a counter-ready reason; ``messages.py``
runs them on every message it builds.
"""

from __future__ import annotations

import math
import re
import typing
from enum import Enum

import numpy as np

from .errors import MessageError

__all__ = ["ID_PATTERN", "MAX_INT", "MAX_MEMBERS", "MAX_NAME", "MAX_PRODUCTS", "ProductNames",
           "NamedEnum", "check_scalar", "frozen_vector", "is_id", "is_product_name"]

# Ids become MQTT topic levels: no wildcards, no '/', nothing a shell or a log mangles.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
# Integers must survive a JSON round trip through any decoder (IEEE doubles are exact below).
MAX_INT = 2**53
MAX_MEMBERS = 4096  # a super node larger than any roster we support
MAX_NAME = 64  # characters of a product's name
MAX_PRODUCTS = 4096  # class slots a fleet may name
# The fleet's products, class 0 first (edge_client/catalogue.py): names, not ids (a space
# inside one is fine), so they are checked as names.
ProductNames = typing.NewType("ProductNames", tuple[str, ...])


class NamedEnum(str, Enum):
    """An enum whose members print, format, compare and serialise as their value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: object, reason: str, what: str) -> NamedEnum:
        """The member whose value is ``value``, else a :class:`MessageError` with ``reason``
        naming ``what`` and the values it may take."""
        try:
            return cls(value)
        except ValueError:
            raise MessageError(reason, f"{what} = {str(value)[:80]!r} is not one of "
                               f"{[e.value for e in cls]}") from None


def is_id(value: object) -> bool:
    """True for a string that is a valid participant or fleet id."""
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


def is_product_name(value: object) -> bool:
    """A product's name: 1-64 printable characters, not a number (a label that is one is a
    class number), no spaces around it."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable() \
        and value == value.strip() and not value.isdigit()


def check_scalar(cls: type, name: str, hint: object, value: object) -> object:
    """Check one header field against its annotation; return the value in its canonical type."""
    # The usual cases first, by exact type: every message's dozen fields pass here (a
    # simulated FedGS iteration builds a message per member and per model).
    if type(value) is hint and (hint is int and 0 <= typing.cast(int, value) < MAX_INT
                                or hint is str and ID_PATTERN.fullmatch(typing.cast(str, value))
                                or hint is float and math.isfinite(typing.cast(float, value))):
        return value
    if hint is bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
    elif hint is int:
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            if 0 <= int(value) < MAX_INT:
                return int(value)
            raise MessageError("out_of_range", f"{cls.__name__}.{name} is outside [0, 2^53)")
    elif hint is float:
        if isinstance(value, (int, float, np.integer, np.floating)) \
                and not isinstance(value, (bool, np.bool_)):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if math.isfinite(number):
                return number
            raise MessageError("non_finite", f"{cls.__name__}.{name} is not a finite float")
    elif hint is str:
        if is_id(value):
            return value
        raise MessageError("bad_id", f"{cls.__name__}.{name} = {str(value)[:80]!r} does not "
                           f"match {ID_PATTERN.pattern}")
    elif isinstance(hint, type) and issubclass(hint, NamedEnum):
        return hint.parse(value, "bad_field", f"{cls.__name__}.{name}")
    elif hint is ProductNames:
        if isinstance(value, (tuple, list)) and len(value) <= MAX_PRODUCTS \
                and all(is_product_name(v) for v in value) and len(set(value)) == len(value):
            return tuple(value)
        raise MessageError("bad_field", f"{cls.__name__}.{name} must be distinct product names")
    elif typing.get_origin(hint) is tuple:
        if isinstance(value, (tuple, list)) and len(value) <= MAX_MEMBERS \
                and all(is_id(v) for v in value):
            return tuple(value)
        raise MessageError("bad_id", f"{cls.__name__}.{name} must be a list of ids")
    wanted = getattr(hint, "__name__", hint)
    raise MessageError("bad_field", f"{cls.__name__}.{name} must be {wanted}, got "
                       f"{type(value).__name__}")


def _immutable(value: object, dtype: type) -> bool:
    """An array over bytes nobody can write (a decoded frame's): freezing needs no copy."""
    if not isinstance(value, np.ndarray) or value.dtype != np.dtype(dtype) \
            or value.flags.writeable:
        return False
    base = value.base
    return isinstance(base, bytes) or (isinstance(base, memoryview) and base.readonly
                                       and isinstance(base.obj, bytes))


def frozen_vector(name: str, value: object, dtype: type) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) and _immutable(value, dtype) \
        else np.array(value, dtype=dtype, copy=True)
    if arr.ndim != 1:
        raise MessageError("wrong_shape", f"{name} must be 1-D, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise MessageError("non_finite", f"{name} contains NaN or Inf")
    if dtype is np.int64 and (arr < 0).any():
        raise MessageError("negative_count", f"{name} has negative counts")
    if arr.flags.writeable:
        arr.flags.writeable = False
    return arr
