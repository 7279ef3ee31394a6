"""`--init-from` by name: a Hugging Face hub id (nvidia/GR00T-N1.6-3B, any org/name) resolved to a local
snapshot through huggingface_hub's cache, as transformers' from_pretrained resolves one: downloaded
once when online, read from the cache when it is there, never downloaded with HF_HUB_OFFLINE=1 (a
one-line error says how to fill the cache then). A directory is used as it is."""

from __future__ import annotations

import os
import re

from loongforge.shared.errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WEIGHT_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")  # no optimizer states, no other formats


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint(ref: str | None) -> str | None:
    """A checkpoint directory, or a hub id -> the local directory of its snapshot."""
    if ref is None or os.path.isdir(ref):
        return ref
    if not HUB_ID.fullmatch(ref) or os.path.exists(ref):
        raise ConfigError(f"--init-from {ref}: not a directory, and not a hub id (org/name, e.g. nvidia/GR00T-N1.6-3B)")
    # huggingface_hub comes with transformers; imported only when a checkpoint is named, not given as a path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(ref, allow_patterns=list(WEIGHT_FILES), local_files_only=offline())
    except LocalEntryNotFoundError:
        raise ConfigError(f"--init-from {ref}: not in the hub cache ({_cache()}) and downloads are off "
                          "(HF_HUB_OFFLINE); fetch it once where the network is reachable (`huggingface-cli download "
                          f"{ref}`) into that cache, or give the checkpoint's directory") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--init-from {ref}: cannot fetch it from the hub ({first}); check the name and network, "
                          f"or give the checkpoint's directory") from None


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
