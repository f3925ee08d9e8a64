"""A loopback stand-in for the Hugging Face Hub: the few endpoints huggingface_hub's snapshot_download, create_repo
and upload_folder call, answered from memory, so Hub transfers are tested without the network.

Written against huggingface_hub 2.4 (hf_api.py, file_download.py, _commit_api.py, _upload_pipeline.py):
- downloads: GET /api/models/{repo}[/revision/{rev}] (sha, siblings), GET /api/models/{repo}/tree/{rev} (the file
  list snapshot_download filters with allow_patterns), HEAD/GET /{repo}/resolve/{rev}/{file} with X-Repo-Commit,
  ETag and Content-Length (what get_hf_file_metadata reads), Range for resumed downloads;
- uploads: POST /api/repos/create (409 when it exists: create_repo(exist_ok=True) accepts that), POST
  /api/validate-yaml (a README.md's metadata), POST /api/models/{repo}/preupload/{rev} answering "regular" for every
  file, so contents come inline, base64, in the NDJSON of POST /api/models/{repo}/commit/{rev}.
Every request is logged in `hub.requests`, so a test can check what a client asked for; writes need the token.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"


def git_oid(data: bytes) -> str:
    """The git blob id the Hub reports for a regular file (huggingface_hub compares it to skip unchanged files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes] = field(default_factory=dict)
    private: bool = False
    commits: list[str] = field(default_factory=list)  # commit ids, oldest first
    last_added: list[str] = field(default_factory=list)  # the files the latest commit sent

    @property
    def sha(self) -> str:
        return self.commits[-1] if self.commits else "0" * 40

    def commit(self, files: dict[str, bytes], deleted: list[str] = (), summary: str = "") -> str:
        self.files.update(files)
        self.last_added = sorted(files)
        for path in deleted:
            self.files.pop(path, None)
        state = json.dumps([self.sha, summary, sorted((p, git_oid(d)) for p, d in self.files.items())])
        self.commits.append(hashlib.sha1(state.encode()).hexdigest())
        return self.sha


class Hub:
    def __init__(self, token: str | None = None):
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> Repo:
        repo = self.repos.setdefault(repo_id, Repo(private=private))
        repo.commit(files, summary="initial")
        return repo

    def downloaded(self) -> list[str]:
        """Files whose content was sent (GET on resolve), in request order."""
        return [
            unquote(p.split("/resolve/", 1)[1].split("/", 1)[1])
            for m, p in self.requests
            if m == "GET" and "/resolve/" in p
        ]

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: pytest shows failures, not every request
            pass

        # --- plumbing ---------------------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, obj, headers: dict | None = None) -> None:
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, message: str, code: str | None = None) -> None:
            # huggingface_hub maps X-Error-Code to RepositoryNotFoundError, RevisionNotFoundError, EntryNotFound
            self._json(status, {"error": message}, {"X-Error-Code": code} if code else None)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _authorised(self) -> bool:
            if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                return True
            self._error(401, "Invalid credentials in Authorization header")
            return False

        def _repo(self, repo_id: str, rev: str | None = None) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (
                repo.private and hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}"
            ):
                self._error(404, "Repository not found", "RepoNotFound")
                return None
            if rev not in (None, "main", repo.sha):
                self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                return None
            return repo

        def _route(self, method: str) -> None:
            parts = urlsplit(self.path)
            path, query = unquote(parts.path), parse_qs(parts.query)
            hub.requests.append((method, path))
            for pattern, verb, handle in ROUTES:
                match = re.fullmatch(pattern, path)
                if match and verb == method:
                    return handle(self, query=query, **match.groupdict())
            if method == "HEAD" and (match := re.fullmatch(RESOLVE, path)):
                return self.resolve(head=True, query=query, **match.groupdict())
            self._error(404, f"no route for {method} {path}")

        def do_GET(self) -> None:
            self._route("GET")

        def do_HEAD(self) -> None:
            self._route("HEAD")

        def do_POST(self) -> None:
            self._route("POST")

        # --- downloads --------------------------------------------------------------------------------------
        def model_info(self, repo: str, rev: str | None = None, query=None) -> None:
            r = self._repo(repo, rev)
            if r:
                self._json(
                    200,
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": r.sha,
                        "private": r.private,
                        "siblings": [{"rfilename": p, "size": len(d)} for p, d in sorted(r.files.items())],
                    },
                )

        def tree(self, repo: str, rev: str, sub: str | None = None, query=None) -> None:
            r = self._repo(repo, rev)
            if r:
                prefix = f"{sub.strip('/')}/" if sub else ""
                self._json(
                    200,
                    [
                        {"type": "file", "path": p, "size": len(d), "oid": git_oid(d)}
                        for p, d in sorted(r.files.items())
                        if p.startswith(prefix)
                    ],
                )

        def resolve(self, repo: str, rev: str, file: str, head: bool = False, query=None) -> None:
            r = self._repo(repo, rev)
            if not r:
                return
            if file not in r.files:
                return self._error(404, f"Entry not found: {file}", "EntryNotFound")
            data = r.files[file]
            headers = {
                "X-Repo-Commit": r.sha,
                "ETag": f'"{git_oid(data)}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            start = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "") or "")
            if start and not head:
                body = data[int(start.group(1)) :]
                headers["Content-Range"] = f"bytes {start.group(1)}-{len(data) - 1}/{len(data)}"
                return self._send(206, body, headers)
            self._send(200, data, {**headers, "Content-Length": len(data)}, head=head)

        # --- uploads ----------------------------------------------------------------------------------------
        def create_repo(self, query=None) -> None:
            if not self._authorised():
                return
            payload = json.loads(self._body() or b"{}")
            repo_id = "/".join(p for p in (payload.get("organization"), payload["name"]) if p)
            if repo_id in hub.repos:
                return self._json(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
            private = payload.get("visibility", "private" if payload.get("private") else "public") != "public"
            hub.repos[repo_id] = Repo(private=private)
            hub.repos[repo_id].commit({".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
            self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def validate_yaml(self, query=None) -> None:
            self._body()
            self._json(200, {"errors": [], "warnings": []})

        def preupload(self, repo: str, rev: str, query=None) -> None:
            if not self._authorised():
                return
            payload = json.loads(self._body())
            r = self._repo(repo, rev)
            if r:
                files = [
                    {
                        "path": f["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": git_oid(r.files[f["path"]]) if f["path"] in r.files else None,
                    }
                    for f in payload["files"]
                ]
                self._json(200, {"files": files, "commitOid": r.sha})

        def commit(self, repo: str, rev: str, query=None) -> None:
            if not self._authorised():
                return
            lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
            r = self._repo(repo, rev)
            if not r:
                return
            added, deleted, summary = {}, [], ""
            for item in lines:
                key, value = item["key"], item["value"]
                if key == "header":
                    summary = value.get("summary", "")
                elif key == "file" and value.get("encoding") == "base64":
                    added[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    deleted.append(value["path"])
                else:  # lfsFile, deletedFolder, copies: never sent while preupload answers "regular"
                    return self._error(400, f"this test hub does not handle {key!r} commit items")
            sha = r.commit(added, deleted, summary)
            self._json(200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None})

    ROUTES = [
        (rf"/api/models/{REPO}/revision/(?P<rev>[^/]+)", "GET", Handler.model_info),
        (rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?P<sub>/.*)?", "GET", Handler.tree),
        (rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "POST", Handler.preupload),
        (rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "POST", Handler.commit),
        (r"/api/repos/create", "POST", Handler.create_repo),
        (r"/api/validate-yaml", "POST", Handler.validate_yaml),
        (rf"/api/models/{REPO}", "GET", Handler.model_info),
        (RESOLVE, "GET", Handler.resolve),
    ]
    return Handler


RESOLVE = rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running loopback Hub with token "test-token"; huggingface_hub in this process talks to it (online, with a
    cache under tmp_path) and child processes get the same through `hub.env`."""
    from huggingface_hub import constants

    with Hub(token="test-token") as server:
        cache = tmp_path / "hf-cache"
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
        server.cache = cache
        server.env = {
            "HF_ENDPOINT": server.url,
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_CACHE": str(cache),
            "HF_HUB_DISABLE_TELEMETRY": "1",
        }
        yield server
