"""Where a frame's label comes from: a sidecar file, a fixed label, or a teacher model."""

from __future__ import annotations

import bisect
import csv
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..errors import SourceError

__all__ = ["FixedLabel", "SidecarLabels", "TeacherLabels"]

log = logging.getLogger(__name__)


class FixedLabel:
    """Every frame has one label (a camera watching one product line)."""

    def __init__(self, label: int, num_classes: int) -> None:
        if not 0 <= label < num_classes:
            raise SourceError(f"fixed label {label} outside [0, {num_classes})")
        self.label = label
        self.counters: Counter[str] = Counter()

    def __call__(self, frame: int, t: float, sample: np.ndarray) -> int | None:
        return self.label


class SidecarLabels:
    """Labels from a JSONL or CSV file keyed by ``frame`` index or timestamp ``t`` (seconds).

    Frame-keyed files label exactly the frames they list: frames they skip are
    gaps, counted as ``unlabelled`` and skipped.  Time-keyed files mark label
    changes: a label holds from its ``t`` until the next entry; an empty label
    starts a gap.  Unknown labels and malformed lines are refused at load with
    their line numbers.
    """

    def __init__(self, path: str | Path, num_classes: int) -> None:
        self.path = Path(path)
        self.counters: Counter[str] = Counter()
        rows = self._rows()
        keys = {k for k, _, _ in rows}
        if len(keys) != 1:
            raise SourceError(f"{self.path}: every line must be keyed the same way, by 'frame' "
                              "or by 't'")
        self.by_time = keys == {"t"}
        errors = [f"line {line}: label {label!r}" for _, line, (_, label) in rows
                  if not (label is None or (type(label) is int and 0 <= label < num_classes))]
        if errors:
            raise SourceError(f"{self.path}: unknown labels (classes are 0..{num_classes - 1}): "
                              + "; ".join(errors[:5]) + (" ..." if len(errors) > 5 else ""))
        # Checked above: each label is a class or a gap.
        entries = sorted((value, cast("int | None", label)) for _, _, (value, label) in rows)
        values = [v for v, _ in entries]
        if len(set(values)) != len(values):
            raise SourceError(f"{self.path}: the same frame or time is labelled twice")
        self._keys, self._labels = values, [lb for _, lb in entries]
        if not self.by_time:
            self._exact = dict(entries)

    def _rows(self) -> list[tuple[str, int, tuple[float, object]]]:
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise SourceError(f"cannot read label sidecar {self.path}: {exc}") from exc
        if self.path.suffix == ".csv":
            records: list[tuple[int, Any]] = [
                (i + 2, r) for i, r in enumerate(csv.DictReader(text.splitlines()))]
        else:
            records = []
            for i, raw in enumerate(text.splitlines(), 1):
                if raw.strip():
                    try:
                        records.append((i, json.loads(raw)))
                    except json.JSONDecodeError as exc:
                        raise SourceError(f"{self.path} line {i}: not JSON ({exc.msg})") from exc
        rows: list[tuple[str, int, tuple[float, object]]] = []
        for line, rec in records:
            if not isinstance(rec, dict):
                raise SourceError(f"{self.path} line {line}: expected an object")
            key = "frame" if "frame" in rec else "t" if "t" in rec else None
            if key is None or "label" not in rec:
                raise SourceError(f"{self.path} line {line}: needs 'frame' or 't', and 'label'")
            try:
                value: float = int(rec[key]) if key == "frame" else float(rec[key])
            except (TypeError, ValueError) as exc:
                raise SourceError(f"{self.path} line {line}: bad {key} {rec[key]!r}") from exc
            rows.append((key, line, (value, _label(rec["label"]))))
        if not rows:
            raise SourceError(f"label sidecar {self.path} is empty")
        return rows

    def __call__(self, frame: int, t: float, sample: np.ndarray) -> int | None:
        if not self.by_time:
            return self._exact.get(frame)
        i = bisect.bisect_right(self._keys, t) - 1
        return self._labels[i] if i >= 0 else None


def _label(raw: object) -> int | None | object:
    """Sidecar label cell -> int, None (gap), or the raw value (reported as unknown)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, int):
        return raw  # a bool stays a bool and is reported as unknown
    if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
        return int(raw)
    return raw


class TeacherLabels:
    """Pseudo-labels from a teacher ONNX model, kept above a confidence threshold."""

    def __init__(self, model: str | Path, *, threshold: float, num_classes: int) -> None:
        from ..trainers.ort_backend import import_onnxruntime

        ort = import_onnxruntime()
        if not 0 < threshold <= 1:
            raise SourceError(f"teacher confidence threshold must be in (0, 1], got {threshold}")
        try:
            self.session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT's own exception types for missing or corrupt files
            raise SourceError(f"cannot load teacher model {model}: {exc}") from exc
        self.input = self.session.get_inputs()[0].name
        self.threshold, self.num_classes = threshold, num_classes
        self.counters: Counter[str] = Counter()

    def __call__(self, frame: int, t: float, sample: np.ndarray) -> int | None:
        logits = self.session.run(None, {self.input: sample[None].astype(np.float32)})[0][0]
        if logits.shape != (self.num_classes,):
            raise SourceError(f"teacher gives {logits.shape} outputs, expected "
                              f"{self.num_classes} classes")
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if probs.max() < self.threshold:
            self.counters["low_confidence"] += 1
            return None
        return int(probs.argmax())
