"""A checkpoint's ``config.json``, read one way for every reader.

The engine reads it before a start (the model's shape, the TP size, the combinations known
to be wrong on a backend) and the envoy tree reads it when it is built (the architecture and
the keys that pick a layer family). Both read the same dict: the file itself for a local
checkpoint, Hugging Face's config for a hub id.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_config(path: str) -> dict:
    """The config of the checkpoint at ``path`` (a local directory, or a hub id through the
    Hugging Face cache), as a dict."""
    local = Path(path) / "config.json"
    if local.exists():
        return json.loads(local.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()
