"""The closed-form heads' figures on a line that changes (``docs/bodies.md``, "Which solve"):
each solve of ``edge_client/head_solves.py`` from the very sums a fleet adds, on the body's
embeddings of Fashion-MNIST at 3x64x64, scored on the full test set, over seeds.

- **A new product**: the sums of 16,000 frames of classes 0-7, then ``k`` labelled frames of
  classes 8 and 9 fleet-wide; accuracy on the new products' test frames, on the old ones'
  (against the head before them), on all ten.
- **As the samples grow** through the number of features (1,280), a point every 100 samples
  to 5,000, on two shapes of input: independent frames, and a camera line's (a few
  exemplars of each of four products, ten noisy frames an item, one label in ten joined to
  the item before); the largest fall below the best accuracy so far, in points.
- **Full data**: 1k to 50k independent frames.
- **Lamps that change**: the head solved on 20,000 frames of the old picture, scored on the
  test frames under three lighting changes as they come and after 500 labelled frames of the
  new picture join the sums, with the frames as they are and stretched before the body
  (``[model] body_input = "autocontrast"``, ``edge_client/body.py``).
- **Unknown parts** (``edge_client/novelty.py``): the sums of 16,000 frames of classes 0-7,
  the detector solved as the cloud solves it (at 1k, 2k, 4k, 8k and 16k frames), each one's
  threshold from the frames after it scored before they joined the sums (as the devices
  score them); AUROC of classes 8 and 9 against the known test frames, and the share of
  each flagged, at the default share of 5%.

The sums are the ones a fleet's devices add whatever the label skew and the order (the
solve from summed statistics is the centralised one: ``tests/test_head_stats.py``), so
the fleet's split changes none of these figures.

    python -m lab.solve_figures [--seeds 3] [--out figures.json] [--only lamps ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_client.body import open_exported
from edge_client.head_solves import solve_lda, solve_ridge
from edge_client.head_stats import HeadSums, augment
from edge_client.novelty import binned, solve_detector, threshold_of

from .datasets import body_folder, camera_frames, embed_images, load_dataset, through_body

__all__ = ["SOLVES", "main"]

SHAPE = (3, 64, 64)
BODY = "efficientnet-lite0"
SOLVES: dict[str, Callable[[HeadSums], tuple[np.ndarray, np.ndarray, float]]] = {
    "ridge": solve_ridge, "lda": solve_lda}
NEW_K = (5, 10, 30, 100, 300)
FULL_N = (1000, 5000, 20000, 50000)
CURVE_N = tuple(range(100, 5001, 100))


class _Rows:
    """Augmented rows of embeddings, summed a prefix at a time."""

    def __init__(self, x: np.ndarray, y: np.ndarray, centre: np.ndarray, clip: float) -> None:
        self.a = augment(x, centre, clip).astype(np.float64)
        self.y, self.classes = np.asarray(y), 10

    def sums(self, idx: np.ndarray, into: HeadSums | None = None) -> HeadSums:
        s = into or HeadSums.zeros(self.a.shape[1] - 1, self.classes)
        for i in range(0, len(idx), 8192):
            part = idx[i:i + 8192]
            s.add_rows(self.a[part], self.y[part])
        return s


def _scores(solve, s: HeadSums, a: np.ndarray) -> np.ndarray:
    w, b, _ = solve(s)
    return a[:, :-1] @ w.T + b


def new_product(train: _Rows, test_a: np.ndarray, yt: np.ndarray, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    old = rng.permutation(np.flatnonzero(train.y < 8))[:16000]
    new = rng.permutation(np.flatnonzero(train.y >= 8))
    base = train.sums(old)
    is_new = yt >= 8
    out: dict = {}
    for name, solve in SOLVES.items():
        before = (_scores(solve, base, test_a).argmax(1) == yt)[~is_new].mean()
        out[name] = {"old_before": float(before)}
        for k in NEW_K:
            s = train.sums(new[:k], into=HeadSums(base.gram.copy(), base.cross.copy(),
                                                   base.counts.copy()))
            ok = _scores(solve, s, test_a).argmax(1) == yt
            out[name][k] = [float(ok[is_new].mean()), float(ok[~is_new].mean()),
                            float(ok.mean())]
    return out


def _gradient(low: float, axis: int) -> np.ndarray:
    """A lamp's fall-off across the picture: ``low`` at one edge to 1 at the other."""
    ramp = np.linspace(low, 1.0, SHAPE[axis], dtype=np.float32)
    return ramp[None, None, :, None] if axis == 1 else ramp[None, None, None, :]


# Three lighting changes: the (lower contrast, brighter, a gradient left to right),
# a lamp gone dim, and glare falling off top to bottom (clipped where it saturates).
LAMPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "dim, flat, graded": lambda f: 0.45 * _gradient(0.7, 2) * f + 0.35,
    "dim": lambda f: 0.6 * f,
    "glare, graded": lambda f: np.clip(1.3 * _gradient(0.7, 1) * f + 0.1, 0.0, 1.0),
}
LAMP_TRAIN, LAMP_NEW = 20000, 500


def lamps(raw, body, centre: np.ndarray, clip: float, seeds: range) -> dict:
    """Accuracy before, at once and after ``LAMP_NEW`` labelled frames of the new picture,
    per lighting change, frames as they are and stretched (see the module)."""
    from edge_client.body import autocontrast

    def embedded(images: np.ndarray, *steps: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        return embed_images(body, images, SHAPE, *steps)

    yt, ytr = np.asarray(raw.y_test), np.asarray(raw.y_train)
    out: dict = {}
    for stretched in (False, True):
        last = (autocontrast,) if stretched else ()
        rows = _Rows(embedded(raw.x_train, *last), ytr, centre, clip)
        test = augment(embedded(raw.x_test, *last), centre, clip).astype(np.float64)
        changed = {name: augment(embedded(raw.x_test, lamp, *last), centre, clip)
                   .astype(np.float64) for name, lamp in LAMPS.items()}
        for seed in seeds:
            order = np.random.default_rng(200 + seed).permutation(len(ytr))
            base = rows.sums(order[:LAMP_TRAIN])
            new = order[LAMP_TRAIN:LAMP_TRAIN + LAMP_NEW]
            for name, lamp in LAMPS.items():
                more = _Rows(embedded(raw.x_train[new], lamp, *last), ytr[new], centre, clip)
                after = more.sums(np.arange(len(new)), into=HeadSums(
                    base.gram.copy(), base.cross.copy(), base.counts.copy()))
                accs = [(_scores(solve_lda, s, a).argmax(1) == yt).mean()
                        for s, a in ((base, test), (base, changed[name]),
                                     (after, changed[name]))]
                out.setdefault(f"{'autocontrast' if stretched else 'as_is'}: {name}",
                               []).append([float(v) for v in accs])
    return out


DETECTOR_AT = (1000, 2000, 4000, 8000, 16000)
UNKNOWN_SHARE = 0.05


def unknown_parts(train: _Rows, test_a: np.ndarray, yt: np.ndarray, seed: int) -> dict:
    """The detector and its threshold as a fleet makes them (see the module)."""
    order = np.random.default_rng(seed).permutation(np.flatnonzero(train.y < 8))
    order = order[:DETECTOR_AT[-1]]
    known = yt < 8
    s, done, threshold, out = None, 0, float("inf"), {}
    for i, n in enumerate(DETECTOR_AT):
        s = train.sums(order[done:n], into=s)
        done = n
        detector = solve_detector(s)
        scores = detector.scores(test_a)
        flagged = scores > threshold  # with the threshold the detector before it calibrated
        out[n] = {"auroc": auroc(scores[~known], scores[known]),
                  "known_flagged": float(flagged[known].mean()),
                  "unknown_flagged": float(flagged[~known].mean())}
        if i + 1 < len(DETECTOR_AT):  # the frames it meets next, scored before they join
            later = train.a[order[n:DETECTOR_AT[i + 1]]]
            threshold = threshold_of(binned(detector.scores(later)), UNKNOWN_SHARE)
            own = scores > threshold
            out[n].update(own_known_flagged=float(own[known].mean()),
                          own_unknown_flagged=float(own[~known].mean()))
    return out


def auroc(positive: np.ndarray, negative: np.ndarray) -> float:
    """The chance that a positive scores above a negative (ties count half)."""
    ranks = np.concatenate([positive, negative]).argsort().argsort() + 1.0
    return float((ranks[:len(positive)].sum() - len(positive) * (len(positive) + 1) / 2)
                 / (len(positive) * len(negative)))


def curve(train: _Rows, test_a: np.ndarray, yt: np.ndarray, order: np.ndarray,
          points: tuple[int, ...]) -> dict:
    """Accuracy of each solve as the sums grow along ``order``, and its largest fall."""
    out: dict = {name: [] for name in SOLVES}
    s, done = None, 0
    for n in points:
        s = train.sums(order[done:n], into=s)
        done = n
        for name, solve in SOLVES.items():
            scores = _scores(solve, s, test_a)[:, :int(yt.max()) + 1]
            out[name].append(float((scores.argmax(1) == yt).mean()))
    return out


def largest_fall(accs: list[float]) -> float:
    """Points below the best so far, at the worst point."""
    best = np.maximum.accumulate(accs)
    return float(100 * (best - np.asarray(accs)).max())


def line_frames(images: np.ndarray, labels: np.ndarray, body, seed: int, n: int = 5000,
                classes: int = 4, variants: int = 3, mislabelled: float = 0.1
                ) -> tuple[np.ndarray, np.ndarray]:
    """A camera line's labelled frames, embedded: items of ``variants`` exemplars per class
    in view for ten frames, each frame with the camera's noise (+-12 of 255), one label in
    ``1 / mislabelled`` joined to the item before."""
    rng = np.random.default_rng(seed)
    pool = [np.flatnonzero(labels == c)[rng.integers(0, 200, variants)] for c in range(classes)]
    exemplars = np.concatenate(pool)
    base = camera_frames(images[exemplars], SHAPE)
    items = rng.integers(0, len(exemplars), n // 10 + 1)
    item_class = labels[exemplars][items]
    out = []
    for i in range(0, n, 500):
        pick = np.repeat(items, 10)[i:i + 500]
        noise = rng.integers(-12, 13, (len(pick), *SHAPE)).astype(np.float32) / 255
        out.append(body.embed(np.clip(base[pick] + noise, 0, 1)))
    y = np.repeat(item_class, 10)[:n].copy()
    wrong = np.flatnonzero(rng.random(n) < mislabelled) // 10 * 10
    y[wrong[wrong >= 10]] = np.repeat(item_class, 10)[wrong[wrong >= 10] - 10]
    return np.concatenate(out)[:n], y


def _summary(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ({np.std(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*", choices=("solves", "lamps"), default=("solves", "lamps"))
    args = ap.parse_args(argv)
    raw = load_dataset("fashion-mnist")
    data = through_body(raw, SHAPE, BODY)
    body = open_exported(body_folder(BODY, SHAPE))
    centre = np.asarray(body.manifest.centre, np.float32)
    clip = body.manifest.row_clip
    train = _Rows(data.x_train, data.y_train, centre, clip)
    test_a = augment(data.x_test, centre, clip).astype(np.float64)
    yt = np.asarray(data.y_test)
    seeds = range(args.seeds)
    figures: dict = {"new_product": [], "full": [], "curve_iid": [], "curve_line": [],
                     "unknown": []}
    if "lamps" in args.only:
        print("lamps that change", file=sys.stderr, flush=True)
        figures["lamps"] = lamps(raw, body, centre, clip, seeds)
    for seed in seeds if "solves" in args.only else ():
        print(f"seed {seed}: unknown parts", file=sys.stderr, flush=True)
        figures["unknown"].append(unknown_parts(train, test_a, yt, seed))
        print(f"seed {seed}: a new product", file=sys.stderr, flush=True)
        figures["new_product"].append(new_product(train, test_a, yt, seed))
        order = np.random.default_rng(100 + seed).permutation(len(train.y))
        figures["full"].append(curve(train, test_a, yt, order, FULL_N))
        print(f"seed {seed}: as the samples grow", file=sys.stderr, flush=True)
        figures["curve_iid"].append(curve(train, test_a, yt, order, CURVE_N))
        x, y = line_frames(raw.x_train, raw.y_train, body, seed)
        line = _Rows(x, y, centre, clip)
        mine = yt < 4
        figures["curve_line"].append(curve(line, test_a[mine], yt[mine],
                                           np.arange(len(y)), CURVE_N))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    _print(figures)
    return 0


def _print(f: dict) -> None:
    if "lamps" in f:
        _print_lamps(f["lamps"])
    if not f["unknown"]:
        return
    _print_unknown(f["unknown"])
    print("A new product: accuracy on its frames / on the old products / on all ten")
    print("| solve | old before | " + " | ".join(f"k = {k}" for k in NEW_K) + " |")
    print("|---" * (len(NEW_K) + 2) + "|")
    for name in SOLVES:
        runs = [r[name] for r in f["new_product"]]
        cells = [_summary([r["old_before"] for r in runs])]
        for k in NEW_K:
            cells.append(" / ".join(f"{np.mean([r[k][i] for r in runs]):.3f}"
                                    for i in range(3)))
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nFull data, independent frames")
    print("| solve | " + " | ".join(f"{n:,}" for n in FULL_N) + " |")
    print("|---" * (len(FULL_N) + 1) + "|")
    for name in SOLVES:
        print(f"| {name} | " + " | ".join(_summary([r[name][i] for r in f["full"]])
                                         for i in range(len(FULL_N))) + " |")
    for shape in ("curve_iid", "curve_line"):
        print(f"\nAs the samples grow ({shape}): accuracy at 1,000 / 1,300 / 2,000 / 5,000, "
              "largest fall below the best so far (points, per seed)")
        at = [CURVE_N.index(n) for n in (1000, 1300, 2000, 5000)]
        for name in SOLVES:
            runs = [r[name] for r in f[shape]]
            accs = " / ".join(_summary([r[i] for r in runs]) for i in at)
            falls = ", ".join(f"{largest_fall(r):.1f}" for r in runs)
            print(f"| {name} | {accs} | {falls} |")


def _print_lamps(runs: dict) -> None:
    print(f"Lamps that change: the head of {LAMP_TRAIN:,} frames on the old picture; accuracy "
          f"on it, on the new one at once, and after {LAMP_NEW} labelled frames of the new one")
    print("| frames | lighting change | old picture | new, at once | new, after 500 |")
    print("|---|---|---|---|---|")
    for key, rows in runs.items():
        body_input, name = key.split(": ")
        print(f"| {body_input} | {name} | " + " | ".join(
            _summary([r[i] for r in rows]) for i in range(3)) + " |")
    print()


def _print_unknown(runs: list[dict]) -> None:
    print("Unknown parts (classes 8, 9 never labelled): AUROC, and the share of known / "
          f"unknown test frames flagged at a threshold for {UNKNOWN_SHARE:.0%}")
    print("| detector solved at | AUROC | flagged, the threshold in use (the one before) "
          "| flagged, its own threshold |")
    print("|---|---|---|---|")
    for n in DETECTOR_AT:
        rows = [r[n] for r in runs]
        own = (" / ".join(_summary([r[k] for r in rows]) for k in ("own_known_flagged",
                                                                     "own_unknown_flagged"))
               if "own_known_flagged" in rows[0] else "")
        print(f"| {n:,} | {_summary([r['auroc'] for r in rows])} | "
              + " / ".join(_summary([r[k] for r in rows]) for k in ("known_flagged",
                                                                     "unknown_flagged"))
              + f" | {own} |")
    print()


if __name__ == "__main__":
    raise SystemExit(main())
