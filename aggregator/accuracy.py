"""The devices' accuracies as operators read them: the mean, and the mean over the worst 10%
of devices, of the held-out (``local``) and prequential figures the devices report.  The
station's and the cloud's summaries, ``safl status`` and the lab's rows use these."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["accuracy_summary", "device_accuracy_summary"]


def accuracy_summary(accuracies: Sequence[float] | np.ndarray,
                     name: str = "local") -> dict[str, float]:
    """Mean of the devices' accuracies (held-out ``local`` or ``prequential``) and the mean
    over the worst 10% of devices (at least one): where keeping part of a local model can pay
    off, a skewed device shows it first.  Empty until some device has measured."""
    if not len(accuracies):
        return {}
    ranked = sorted(float(a) for a in accuracies)
    worst = ranked[:max(1, len(ranked) // 10)]
    return {f"{name}_mean": float(np.mean(ranked)), f"{name}_worst10": float(np.mean(worst))}


def device_accuracy_summary(local: Sequence[float] | np.ndarray,
                            prequential: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Held-out (``local_*``) and prequential (``prequential_*``) accuracy of the devices
    that measured each: mean and worst 10%."""
    return {**accuracy_summary(local), **accuracy_summary(prequential, "prequential")}
