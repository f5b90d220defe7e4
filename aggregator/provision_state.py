"""What a re-run of ``safl provision`` must remember of the runs before it (``state.json``
beside the fleet's tree): the ids issued, those revoked with their certificates' serials,
and the fleet's products in class order, which a re-run may only add to.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge_client.errors import ConfigError

from .pki import write_private

__all__ = ["ProvisionState"]


class ProvisionState:
    """What re-runs need: ids issued, and the revoked ids and certificate serials."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = json.loads(path.read_text()) if path.exists() else {}
        # Fleets provisioned before certificates were identities kept passwords here.
        issued = set(doc.get("issued", [])) | set(doc.get("passwords", {}))
        self.doc = {"issued": sorted(issued), "revoked": doc.get("revoked", []),
                    "revoked_serials": doc.get("revoked_serials", []),
                    "products": doc.get("products", [])}

    def products(self, names: tuple[str, ...]) -> None:
        """The fleet's products, remembered: a re-run may add to the end of the list (a
        product added to the running fleet), never move, rename or drop one, which would
        turn one product's statistics and head into another's (catalogue.py)."""
        before = tuple(self.doc["products"])
        if names[:len(before)] != before:
            raise ConfigError("class_names", f"{list(names)} do not begin with the products "
                              f"this fleet was provisioned with, {list(before)}: add a product "
                              "at the end, retire one with [model] retired")
        self.doc["products"] = list(names)

    def save(self) -> None:
        write_private(self.path, (json.dumps(self.doc, indent=2, sort_keys=True) + "\n").encode())
