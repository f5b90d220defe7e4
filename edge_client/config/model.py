"""``ModelConfig``: the ``[model]`` table every role shares."""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError
from ..messages import MAX_NAME, is_product_name
from .loading import check_range

__all__ = ["ModelConfig", "MAX_NAME"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The federation's model (the ``[model]`` table every role shares).

    ``backend`` is the trainer this role uses; ``artifacts`` the exported folder
    for ``ort``.  ``seed`` fixes the initial weights the cloud broadcasts.  ``module``
    names your own torch model instead of a zoo ``name``.
    """

    @property
    def spec(self) -> str:
        """What the trainers build: your module, else the zoo name."""
        return self.module or self.name

    name: str = "mlp"  # a zoo model (safl models list), or the head of an exported one
    backend: str = "numpy"
    input_shape: tuple[int, ...] = (28, 28)  # one sample's shape, as the source delivers it
    num_classes: int = 10  # classes the model tells apart
    artifacts: str = ""
    seed: int = 0
    device: str = "auto"  # torch: "auto" (CUDA where available), "cpu", "cuda" or "cuda:N"
    # Your own torch model, "package.module:factory" (docs/own-model.md): used instead of name.
    module: str = ""
    # A frozen pretrained body before the model (docs/bodies.md): "none", "efficientnet-lite0"
    # or "package.module:factory"; the model (name) is then the head, trained on its embeddings.
    body: str = "none"
    body_dir: str = ""  # the folder `safl models export-body` wrote (the same on every role)
    hidden: int = 128  # the mlp's hidden units (the mlp head's, with a body)
    # Fine-tuning (docs/bodies.md): the body's last N blocks train and federate with the head
    # (torch backend only; 0: the body stays frozen).
    train_body_blocks: int = 0
    # How the head starts (docs/bodies.md, "A head solved from what the fleet has seen"):
    # "random"; "lda" or "ridge", solved in closed form from the statistics every device
    # sums (lda: a discriminant with equal class priors, so that a new product is learnt
    # from its first hundred frames; ridge: one-hot targets, each class weighed by its
    # frames); "ncm" (class means only); "auto": lda for a linear head on a frozen body,
    # ridge where its last blocks train, else random.  With train_body_blocks, the head is
    # solved once on the pretrained body and stays fixed while the blocks train (Fed3R+FT).
    head_init: str = "auto"
    # "every": each round's global head is the latest solve from all the statistics so far,
    # whatever the devices' SGD made of it (measured better under label skew:
    # docs/bodies.md); "once": the first solve starts the federation's fine-tuning, which
    # then goes on from it; "auto": every on a frozen body, once where its blocks train.
    head_resolve: str = "auto"
    # The products' names, class 0 first, the classes past the last free for products to
    # come (docs/camera-line.md, "A new product"): a label may name its product instead of
    # its number, each prediction carries the name, and a name added at the end (then `safl
    # provision`) reaches the running fleet with its next model, the frames labelled with it
    # held by the devices until then (edge_client/catalogue.py).  () leaves them numbers.
    class_names: tuple[str, ...] = ()
    # Products no longer made, by name (they stay in class_names): never predicted, their
    # statistics kept, in production again once taken off this list.  The cloud's is the
    # fleet's: it tells every role with its next model.
    retired: tuple[str, ...] = ()
    # What a frame goes through before the body (docs/camera-line.md, "Lamps that change"):
    # "autocontrast", each frame stretched between its 1st and 99th percentiles (a lamp
    # change then costs 0.4 points in the lab, against 17 as the frames come; what a line
    # should use), or "as_is" (the default: statistics summed before it existed stay valid).
    body_input: str = "as_is"
    # The share of known frames a prediction's unknown flag may fall on (docs/camera-line.md,
    # "Unknown parts"): the cloud sets one threshold for the fleet from its devices' scores
    # of labelled frames (edge_client/novelty.py); 0 flags nothing.  Read by the cloud.
    unknown_share: float = 0.05

    @property
    def head_kind(self) -> str:
        """What ``head_init`` comes to: ``random``, ``lda``, ``ridge`` or ``ncm``."""
        if self.head_init != "auto":
            return self.head_init
        if not self._head_solvable:
            return "random"
        return "ridge" if self.train_body_blocks else "lda"

    @property
    def head_resolution(self) -> str:
        """What ``head_resolve`` comes to: ``once`` or ``every``."""
        if self.head_resolve != "auto":
            return self.head_resolve
        return "once" if self.train_body_blocks else "every"

    def _check_class_names(self) -> None:
        names = self.class_names
        if not names:
            return
        if len(names) > self.num_classes:
            raise ConfigError("class_names", f"{len(names)} names for num_classes = "
                              f"{self.num_classes}: a product past the model's classes needs "
                              "a fleet with more (leave spare classes for products to come)")
        bad = [n for n in names if not is_product_name(n)]
        if bad:
            raise ConfigError("class_names", f"{bad[0][:80]!r} is not a product name: 1-"
                              f"{MAX_NAME} printable characters, not a number, no spaces "
                              "around it")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError("class_names", f"{', '.join(twice)} named twice")

    def _check_retired(self) -> None:
        unknown = [n for n in self.retired if n not in self.class_names]
        if unknown:
            raise ConfigError("retired", f"{unknown[0][:80]!r} is not in class_names: a "
                              "product is retired by name, and stays in class_names")
        if self.class_names and set(self.retired) == set(self.class_names):
            raise ConfigError("retired", "every product retired: a line needs one to predict")

    @property
    def _head_solvable(self) -> bool:
        """A linear head on a body: what a closed-form solve can start (where the body's
        last blocks train, solved on the pretrained body's embeddings: Fed3R+FT)."""
        return self.body != "none" and self.name in ("linear", "softmax") and not self.module

    def __post_init__(self) -> None:
        if self.backend not in ("numpy", "torch", "ort"):
            raise ConfigError("backend", f"must be numpy, torch or ort, got {self.backend!r}")
        if self.module and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.module):
            raise ConfigError("module", f"must be 'package.module:factory', got {self.module!r}")
        if self.module and self.backend == "numpy":
            raise ConfigError("module", "your own model needs backend = 'torch' (or 'ort' with "
                              "artifacts from safl models export --from-module)")
        if re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is None:
            raise ConfigError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got "
                              f"{self.device!r}")
        if self.device not in ("auto", "cpu") and self.backend != "torch":
            raise ConfigError("device", f"{self.device!r} needs backend = 'torch'")
        if self.backend == "ort" and not self.artifacts:
            raise ConfigError("artifacts", "the ort backend needs the exported artifacts folder")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ConfigError("input_shape", f"must be positive sizes, got {self.input_shape}")
        check_range("num_classes", self.num_classes, 2)
        self._check_class_names()
        self._check_retired()
        check_range("unknown_share", self.unknown_share, 0, 0.5)
        if self.body_input not in ("autocontrast", "as_is"):
            raise ConfigError("body_input", f"must be autocontrast or as_is, got "
                              f"{self.body_input!r}")
        check_range("hidden", self.hidden, 1)
        if self.body != "none" and not self.body_dir:
            raise ConfigError("body_dir", f"body {self.body!r} needs the folder `safl models "
                              "export-body` wrote (the same on every role)")
        if self.body_dir and self.body == "none":
            raise ConfigError("body", "body_dir is set but body is 'none': name the body")
        check_range("train_body_blocks", self.train_body_blocks, 0)
        if self.head_init not in ("auto", "random", "lda", "ridge", "ncm"):
            raise ConfigError("head_init", f"must be auto, random, lda, ridge or ncm, got "
                              f"{self.head_init!r}")
        if self.head_resolve not in ("auto", "once", "every"):
            raise ConfigError("head_resolve", f"must be auto, once or every, got "
                              f"{self.head_resolve!r}")
        if self.head_init in ("lda", "ridge", "ncm") and not self._head_solvable:
            raise ConfigError("head_init", f"{self.head_init!r} solves a linear head on a "
                              "body: it needs a body and name = 'linear'")
        if self.head_kind != "random" and self.train_body_blocks \
                and self.head_resolution != "once":
            raise ConfigError("head_resolve", "with train_body_blocks the head is solved "
                              "once, on the pretrained body, and stays fixed while the blocks "
                              "learn features for it: a later solve, on the pretrained "
                              "body's embeddings, would not fit them (head_resolve = 'once' "
                              "or 'auto')")
        if self.train_body_blocks and self.body == "none":
            raise ConfigError("train_body_blocks", "needs a body (body = 'none')")
        if self.train_body_blocks and self.backend != "torch":
            raise ConfigError("train_body_blocks", f"a body's blocks train on torch only, "
                              f"backend is {self.backend!r} (a board without torch trains "
                              "the head on the frozen body: train_body_blocks = 0)")
