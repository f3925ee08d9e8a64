"""`sdpipe runpod` through the real runpod SDK against a loopback server that answers like Runpod's GraphQL API
and records every request: the fields sent, the price shown before anything is created, errors turned into one
line, and the API key in no output or file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

pytest.importorskip("runpod")
KEY = "rpa_TESTKEY_0123456789abcdef"
GPU = {
    "id": "NVIDIA H100 80GB HBM3",
    "displayName": "H100 SXM",
    "maxGpuCount": 8,
    "securePrice": 2.99,
    "communityPrice": 2.69,
    "memoryInGb": 80,
    "lowestPrice": {"minimumBidPrice": 1.5, "uninterruptablePrice": 2.69},
}
POD = {
    "id": "pod-abc123",
    "name": "sdpipe",
    "desiredStatus": "RUNNING",
    "gpuCount": 2,
    "costPerHr": 5.98,
    "uptimeSeconds": 42,
    "machine": {"gpuDisplayName": "H100 SXM"},
    "runtime": {
        "ports": [{"ip": "203.0.113.7", "isIpPublic": True, "privatePort": 22, "publicPort": 22017, "type": "tcp"}]
    },
}


class FakeRunpod(BaseHTTPRequestHandler):
    requests: list = []
    capacity = True
    echo = False  # answer errors that quote the request's headers, as some API servers and proxies do

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        query = body["query"]
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "query": query})
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": "unauthorized"})
        if self.echo:
            return self._send(200, {"errors": [{"message": f"bad request; headers {dict(self.headers)}"}]})
        if "podFindAndDeployOnDemand" in query:
            if not self.capacity:
                return self._send(
                    200,
                    {
                        "errors": [
                            {
                                "message": "There are no longer any instances available with "
                                "the requested specifications. Please refresh and try again."
                            }
                        ]
                    },
                )
            return self._send(200, {"data": {"podFindAndDeployOnDemand": {"id": POD["id"], "imageName": "img"}}})
        if "gpuTypes" in query:
            return self._send(200, {"data": {"gpuTypes": [GPU]}})
        if "podStop" in query:
            return self._send(200, {"data": {"podStop": {"id": POD["id"], "desiredStatus": "EXITED"}}})
        if "podTerminate" in query:
            return self._send(200, {"data": {"podTerminate": None}})
        if "pod(input" in query:
            return self._send(200, {"data": {"pod": POD}})
        return self._send(200, {"errors": [{"message": f"unexpected query {query[:60]}"}]})

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def api(tmp_path):
    FakeRunpod.requests, FakeRunpod.capacity, FakeRunpod.echo = [], True, False
    server = HTTPServer(("127.0.0.1", 0), FakeRunpod)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def sdpipe_runpod(tmp_path, api, *args, key=KEY, stdin="", extra_path=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD")}
    env.update(RUNPOD_API_BASE_URL=api, HOME=str(tmp_path / "home"))
    if key:
        env["RUNPOD_API_KEY"] = key
    if extra_path:
        env["PATH"] = f"{extra_path}:{env['PATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "sdpipe", "runpod", *args],
        cwd=tmp_path,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
    )
    leaked = [name for name, text in (("stdout", proc.stdout), ("stderr", proc.stderr)) if KEY in text]
    assert not leaked, f"the API key appeared in {leaked}"
    return proc


def test_up_prints_the_price_then_creates_the_pod(tmp_path, api):
    proc = sdpipe_runpod(tmp_path, api, "up", "--gpus", "2", "--image", "me/sdpipe:1", "--target", "train", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert "2 x H100 SXM (secure cloud): $2.99/GPU/h, about $5.98/h" in proc.stdout
    assert "created pod pod-abc123" in proc.stdout
    deploy = [r["query"] for r in FakeRunpod.requests if "podFindAndDeployOnDemand" in r["query"]]
    assert len(deploy) == 1
    for field in (
        'gpuTypeId: "NVIDIA H100 80GB HBM3"',
        "gpuCount: 2",
        'volumeMountPath: "/workspace"',
        'imageName: "me/sdpipe:1"',
        "cloudType: SECURE",
        '"SDPIPE_TARGET"',
        '"train"',
    ):
        assert field in deploy[0], field
    assert all(r["path"] == "/graphql" for r in FakeRunpod.requests)
    state = (tmp_path / ".sdpipe" / "runpod.json").read_text()
    assert json.loads(state)["id"] == "pod-abc123" and KEY not in state


def test_up_asks_first_and_creates_nothing_on_no(tmp_path, api):
    proc = sdpipe_runpod(tmp_path, api, "up", "--gpus", "8", stdin="n\n")
    assert proc.returncode == 1 and "about $23.92/h" in proc.stdout and "nothing created" in proc.stdout
    assert not any("podFindAndDeployOnDemand" in r["query"] for r in FakeRunpod.requests)


@pytest.mark.parametrize(
    "setup, message",
    [
        ("no_capacity", "Runpod has no capacity for this request"),
        ("bad_key", "Runpod refused the API key"),
        ("no_key", "no Runpod API key: set RUNPOD_API_KEY or run `runpod config`"),
        ("too_many", "--gpus 9: a H100 SXM pod has at most 8"),
    ],
)
def test_errors_are_one_line(tmp_path, api, setup, message):
    FakeRunpod.capacity = setup != "no_capacity"
    key = {"bad_key": "rpa_WRONG", "no_key": None}.get(setup, KEY)
    proc = sdpipe_runpod(tmp_path, api, "up", "--gpus", "9" if setup == "too_many" else "1", "--yes", key=key)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_status_sync_and_down_use_the_remembered_pod(tmp_path, api):
    sdpipe_runpod(tmp_path, api, "up", "--gpus", "2", "--yes")
    status = sdpipe_runpod(tmp_path, api, "status")
    assert "pod pod-abc123 (sdpipe): RUNNING, 2 x H100 SXM, $5.98/h" in status.stdout
    assert "ssh -p 22017 root@203.0.113.7" in status.stdout
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "rsync").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "rsync.args"}\n')
    (fake / "rsync").chmod(0o755)
    sync = sdpipe_runpod(tmp_path, api, "sync", extra_path=fake)
    assert sync.returncode == 0, sync.stderr
    args = (tmp_path / "rsync.args").read_text()
    assert "ssh -p 22017" in args and "root@203.0.113.7:/workspace/project/results/" in args
    assert "Logs" in sdpipe_runpod(tmp_path, api, "logs").stdout
    down = sdpipe_runpod(tmp_path, api, "down")
    assert "GPU billing ended" in down.stdout and any("podStop" in r["query"] for r in FakeRunpod.requests)
    gone = sdpipe_runpod(tmp_path, api, "down", "--terminate", "--yes")
    assert "nothing is billed" in gone.stdout and any("podTerminate" in r["query"] for r in FakeRunpod.requests)
    assert not (tmp_path / ".sdpipe" / "runpod.json").exists()
    # Every request carried the key only in its Authorization header.
    assert all(r["auth"] == f"Bearer {KEY}" and KEY not in r["query"] for r in FakeRunpod.requests)


def test_a_server_that_echoes_the_key_does_not_make_us_print_it(tmp_path, api):
    """Issue 26, item 7: an error quoting the request's Authorization header was printed as it came."""
    FakeRunpod.echo = True
    proc = sdpipe_runpod(tmp_path, api, "up", "--gpus", "1", "--yes")  # asserts the key is in no output
    assert proc.returncode == 2 and "Bearer ***" in proc.stderr
