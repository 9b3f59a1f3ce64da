"""Whether and how the Hugging Face Hub can be used: the offline switch, an unreachable host, the local cache.

Split from :mod:`peftplug.loading` (which re-exports these): a model name that is not local resolves through here
so that a machine without network fails at once instead of retrying each file for a minute.
"""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is switched off, read as huggingface_hub reads it (``HF_HUB_OFFLINE``, else
    ``TRANSFORMERS_OFFLINE``; ``1``, ``true``, ``yes`` or ``on`` in any case), at call time."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@functools.lru_cache(maxsize=4)
def _unresolvable_host(endpoint: str) -> str | None:
    """Why the host of ``endpoint`` cannot be resolved, or ``None`` if it can (asked once per process)."""
    host = urllib.parse.urlparse(endpoint).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"{host} cannot be resolved: {err.strerror or err}"
    return None


def hub_unreachable() -> str | None:
    """Why the Hub surely cannot be reached (its host does not resolve and no proxy would resolve it), or ``None``.

    Without this, huggingface_hub retries every file of an unknown name for ~45 s on a machine without network,
    twice per load (tokenizer and model), before saying it could not connect.
    """
    if any(os.environ.get(key) for key in _PROXY_VARIABLES):
        return None  # a proxy resolves the host itself
    return _unresolvable_host(os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"))


def cached_hub_snapshot(name: str) -> str | None:
    """The folder of the Hugging Face cache that holds Hub model ``name`` (revision ``main``), or ``None``."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        try:
            found = try_to_load_from_cache(name, filename)
        except ValueError:  # not a valid repo id
            return None
        if isinstance(found, str):
            return os.path.dirname(found)
    return None
