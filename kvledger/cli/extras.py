"""Which extra a command needs when one of its imports is missing: `make run` (and `pip install
kvledger`) installs only what generation needs, so `kvledger serve`, `check`, `fuzz`, `zoo`,
`coverage` and `mutation` each name the extra to install instead of ending in a traceback."""

from __future__ import annotations

import importlib.util
from typing import Dict, Optional

# top-level module -> the extra of pyproject.toml that brings it
EXTRA_OF: Dict[str, str] = {
    "fastapi": "serve",
    "uvicorn": "serve",
    "starlette": "serve",
    "httpx": "serve",
    "prometheus_client": "serve",
    "hypothesis": "tools",
    "matplotlib": "tools",
    "coverage": "tools",
    "accelerate": "tools",
    "cosmic_ray": "mutation",
    "ray": "cluster",
    "openai": "test",
    "pytest": "test",
}


def missing_extra(exc: ModuleNotFoundError, command: str) -> Optional[str]:
    """The message for a command that failed because an extra is not installed; None when the
    missing module is no extra's (a real error, to be raised as it is)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None or importlib.util.find_spec(top) is not None:
        return None
    return (
        f"kvledger {command} needs the '{extra}' extra ({top} is not installed): "
        f"pip install -c constraints.txt -e '.[{extra}]', or `make install` for all of them"
    )
