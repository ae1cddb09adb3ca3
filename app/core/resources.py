"""Files under resources/: the same lookup from a source checkout and from a frozen build."""
from __future__ import annotations

import sys
from pathlib import Path


def resource_path(name: str) -> Path:
    """In a bundle: _internal/resources; in a checkout: resources/ at the top; installed by
    pip (`pip install .`, a wheel): <prefix>/share/ebb/resources, where the wheel puts them."""
    meipass = getattr(sys, "_MEIPASS", None)
    if meipass is not None:
        return Path(meipass) / "resources" / name
    checkout = Path(__file__).resolve().parents[2] / "resources" / name  # app/core/ → the top
    if checkout.exists():
        return checkout
    return Path(sys.prefix) / "share" / "ebb" / "resources" / name
