"""Models by name: a ``model`` that is no local path but a hub id (``org/name``, or
``org/name@revision`` for a branch, tag or commit) is fetched with huggingface_hub into
the HF cache, and what loads it gets the snapshot directory.

``omnistage serve org/name`` fetches in the head, before the pipeline is picked from the
checkpoint's config.json, and names the model ``org/name@<commit>`` in the stages it
builds: every replica then loads that same commit, a local one from the cache the head
filled (no request to the hub), a headless one on another host from its own cache or its
own HF_ENDPOINT. A hub id in a deploy config's stage is fetched by the replicas that
load it (the cache's file locks let replicas on one host share a download).

The HF variables are read when a model is resolved, not when huggingface_hub is
imported: HF_ENDPOINT, HF_HUB_CACHE / HF_HOME, HF_TOKEN, and HF_HUB_OFFLINE as the
user set it (``envs.hub_offline``), so the engines' own offline switch, which they turn
on once their model is local, never hides a hub from the next fetch.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage import envs
from omnistage.protocol.errors import ConfigError

log = logging.getLogger(__name__)

# org/name: what the hub accepts as a model id; a revision after "@".
_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]+))?"
)
# Names that look like org/name but are files someone meant (a config, a GGUF).
_FILE_SUFFIXES = (".yaml", ".yml", ".json", ".gguf", ".safetensors", ".bin", ".pt")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


def parse_hub_id(model: str) -> HubId | None:
    """The hub id ``model`` names, or None where it is a local path (existing or not:
    absolute, relative with ./ or ~, a file name) or not shaped as one."""
    if Path(model).expanduser().exists():
        return None
    match = _HUB_ID.fullmatch(model)
    if match is None or ".." in model or match["repo"].endswith(_FILE_SUFFIXES):
        return None
    return HubId(match["repo"], match["revision"])


def is_hub_id(model: str) -> bool:
    return parse_hub_id(model) is not None


def resolve(model: str) -> Path:
    """A local path for ``model``: the path itself, or the snapshot a hub id names
    (fetched if needed). Raises ConfigError when a hub id cannot be had."""
    hub_id = parse_hub_id(model)
    if hub_id is None:
        return Path(model).expanduser()
    return fetch(hub_id)


def fetch(hub_id: HubId) -> Path:
    """The snapshot directory of ``hub_id`` in the HF cache, downloading what is missing
    (huggingface_hub's progress bars show it); a commit already cached needs no hub."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(
            str(hub_id), "fetching a model by hub id needs huggingface_hub: pip install it"
        ) from None
    cache, endpoint = envs.hf_hub_cache(), envs.hf_endpoint()
    kwargs: dict[str, Any] = {
        "repo_id": hub_id.repo,
        "revision": hub_id.revision,
        "cache_dir": cache,
        "endpoint": endpoint,
        "token": envs.hf_token(),
    }
    offline = envs.hub_offline()
    if offline or _COMMIT.fullmatch(hub_id.revision or ""):
        try:
            return Path(snapshot_download(**kwargs, local_files_only=True))
        except LocalEntryNotFoundError:
            if offline:
                raise _not_cached(hub_id, cache, "HF_HUB_OFFLINE is set") from None
    log.info("fetching %s from %s into %s", hub_id, endpoint, cache)
    started = time.monotonic()
    try:
        path = Path(snapshot_download(**kwargs))
    except LocalEntryNotFoundError as exc:
        # huggingface_hub's word for "the hub did not answer and the cache has nothing".
        cause = exc.__cause__ or exc
        raise _not_cached(hub_id, cache, f"{endpoint} did not answer ({cause})") from None
    except HfHubHTTPError as exc:
        raise _refused(hub_id, endpoint, exc) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(str(hub_id), f"fetching from {endpoint} failed: {exc}") from None
    log.info("%s is %s (%.1fs)", hub_id, path, time.monotonic() - started)
    return path


def _refused(hub_id: HubId, endpoint: str, exc: Any) -> ConfigError:
    """What the hub's error answer means, in words."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        why = "lets only some users fetch it: set HF_TOKEN"
    elif isinstance(exc, RepositoryNotFoundError):
        why = (
            f"has no model {hub_id.repo!r} (nor is it a local path; a private model needs HF_TOKEN)"
        )
    elif isinstance(exc, RevisionNotFoundError):
        why = f"has {hub_id.repo!r} but no revision {hub_id.revision!r}"
    else:
        status = exc.response.status_code if exc.response is not None else "?"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        why = f"answered {status}: {first} (or pass a local path)"
    return ConfigError(str(hub_id), f"{endpoint} {why}")


def _not_cached(hub_id: HubId, cache: str, why: str) -> ConfigError:
    return ConfigError(
        str(hub_id),
        f"not a local path, not in the HF cache ({cache}), and {why}: set HF_ENDPOINT to a "
        "hub this machine reaches (and HF_HUB_OFFLINE=0), download it into the cache "
        "(hf download), or pass a local path",
    )


def pinned(hub_id: HubId, directory: Path) -> str:
    """``org/name@<commit>`` for a fetched snapshot (its directory is named by the
    commit): what the stages of a pipeline built from it load."""
    commit = directory.name
    return f"{hub_id.repo}@{commit}" if _COMMIT.fullmatch(commit) else str(hub_id)
