"""A local HF-compatible hub on 127.0.0.1, for tests: point HF_ENDPOINT at it and
huggingface_hub's ``snapshot_download`` fetches the directories it serves.

Only the routes ``snapshot_download`` uses: the revision's info
(``/api/models/{repo}/revision/{rev}``, its ``sha`` the commit), the file tree
(``/api/models/{repo}/tree/{rev}``), and each file (``HEAD``/``GET
/{repo}/resolve/{rev}/{path}`` with X-Repo-Commit, ETag and Content-Length). A repo has
one commit, a hash of its files; ``main`` and that hash name it. ``requests`` counts what
was asked, so a test can tell a fetch from a cache hit.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + self.files[name])
        self.commit = digest.hexdigest()

    @classmethod
    def from_dir(cls, directory: Path) -> Repo:
        return cls(
            {
                str(p.relative_to(directory)): p.read_bytes()
                for p in sorted(directory.rglob("*"))
                if p.is_file()
            }
        )


def _oid(data: bytes) -> str:
    """git's blob id, as the hub gives it for a file stored in git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HfEndpoint:
    repos: dict[str, Repo]
    url: str = ""
    requests: Counter[str] = field(default_factory=Counter)


def _handler(hub: HfEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests[f"{self.command} {path}"] += 1
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"))
            else:
                self._resolve(path.lstrip("/"), body)

        def _repo(self, org: str, name: str, rev: str) -> Repo | None:
            repo = hub.repos.get(f"{org}/{name}")
            if repo is None:
                self._send(
                    404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}
                )
            elif rev not in ("main", repo.commit):
                self._send(404, b'{"error":"Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                return None
            return repo

        def _api(self, rest: str) -> None:
            parts = rest.split("/")
            if len(parts) < 4 or parts[2] not in ("revision", "tree"):
                self._send(404, b'{"error":"not found"}', {})
                return
            org, name, what, rev = parts[:4]
            repo = self._repo(org, name, rev)
            if repo is None:
                return
            if what == "revision":
                info = {
                    "id": f"{org}/{name}",
                    "modelId": f"{org}/{name}",
                    "sha": repo.commit,
                    "private": False,
                    "siblings": [{"rfilename": n} for n in repo.files],
                }
            else:
                info = [
                    {"type": "file", "path": n, "size": len(d), "oid": _oid(d)}
                    for n, d in repo.files.items()
                ]
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

        def _resolve(self, path: str, body: bool) -> None:
            parts = path.split("/", 4)
            if len(parts) < 5 or parts[2] != "resolve":
                self._send(404, b"not found", {})
                return
            org, name, _, rev, filename = parts
            repo = self._repo(org, name, rev)
            if repo is None:
                return
            data = repo.files.get(filename)
            if data is None:
                self._send(404, b"entry not found", {"X-Error-Code": "EntryNotFound"})
                return
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{_oid(data)}"'}
            self._send(200, data if body else b"", headers, length=len(data))

        def _send(
            self, status: int, data: bytes, headers: dict[str, str], length: int = -1
        ) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data) if length < 0 else length))
            self.end_headers()
            if data:
                self.wfile.write(data)

    return Handler


@contextmanager
def hf_endpoint(repos: dict[str, Repo]) -> Iterator[HfEndpoint]:
    """Serve ``repos`` (``org/name`` -> Repo) on a free port of 127.0.0.1 meanwhile."""
    hub = HfEndpoint(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    """Serve directories by hand: ``python -m tests.hf_endpoint org/name=DIR ...``."""
    import sys
    import time

    repos = {}
    for arg in sys.argv[1:]:
        repo_id, directory = arg.split("=", 1)
        repos[repo_id] = Repo.from_dir(Path(directory))
    with hf_endpoint(repos) as hub:
        print(hub.url, flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
