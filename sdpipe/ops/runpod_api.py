"""`sdpipe runpod up|status|logs|sync|down`: one Runpod pod for the whole pipeline, through the official `runpod`
SDK (pip install 'sdpipe[runpod]').

The pod runs the image built from this repository's Dockerfile; its entrypoint (`sdpipe pod`) runs the workflow on
the pod's volume at /workspace. The API key comes from RUNPOD_API_KEY or ~/.runpod/config.toml (`runpod config`)
and is never printed or written anywhere. The last pod created from a project is remembered in
.sdpipe/runpod.json, so `status`, `sync` and `down` need no id.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from sdpipe import io
from sdpipe.errors import UserError

STATE = Path(".sdpipe/runpod.json")
WORKSPACE = "/workspace"
DEFAULT_IMAGE = "ghcr.io/your-org/sdpipe:latest"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="create a pod (prints the price per hour and asks first)")
    up.add_argument("--gpus", type=int, default=1)
    up.add_argument("--gpu-type", default="NVIDIA H100 80GB HBM3", help="a Runpod GPU type id")
    up.add_argument("--image", default=os.environ.get("SDPIPE_IMAGE", DEFAULT_IMAGE))
    up.add_argument("--cloud", choices=["SECURE", "COMMUNITY", "ALL"], default="SECURE")
    up.add_argument("--volume-gb", type=int, default=200, help="the pod volume at /workspace (caches, results)")
    up.add_argument("--disk-gb", type=int, default=50, help="container disk")
    up.add_argument("--name", default="sdpipe")
    up.add_argument("--target", default="", help="Snakemake targets (default: the whole pipeline)")
    up.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    up.add_argument("--yes", action="store_true", help="create without asking")
    for name, text in (
        ("status", "the pod's state, GPUs, price and SSH address"),
        ("logs", "how to follow the pod's logs"),
        ("sync", "copy results/ (exports included) back from the pod with rsync over SSH"),
        ("down", "stop the pod (GPU billing ends; the volume is kept) or --terminate it"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--pod", help="pod id (default: the last one `up` created here)")
        if name == "sync":
            p.add_argument("--dest", default=".", help="local project folder to copy into")
        if name == "down":
            p.add_argument("--terminate", action="store_true", help="delete the pod and its volume")
            p.add_argument("--yes", action="store_true")


def _sdk():
    """The SDK with the API key set; the key itself never leaves this function."""
    try:
        import runpod
    except ImportError:
        raise UserError("the runpod SDK is not installed: pip install 'sdpipe[runpod]'") from None
    key = os.environ.get("RUNPOD_API_KEY") or (runpod.get_credentials() or {}).get("api_key")
    if not key:
        raise UserError("no Runpod API key: set RUNPOD_API_KEY or run `runpod config`")
    runpod.api_key = key
    return runpod


def _call(fn, *args, **kwargs):
    """An SDK call whose failures become one line, with the API key masked wherever a server echoed it back."""
    import runpod
    from runpod import error

    try:
        return fn(*args, **kwargs)
    except error.AuthenticationError:
        raise UserError("Runpod refused the API key (check RUNPOD_API_KEY or ~/.runpod/config.toml)") from None
    except (error.QueryError, OSError, ValueError) as exc:
        raise _one_line(redact(str(exc), runpod.api_key)) from None


def redact(text: str, key: str | None) -> str:
    """`text` with every occurrence of `key` replaced (a server may echo the request's headers in its errors)."""
    return text.replace(key, "***") if key else text


def _one_line(text: str) -> UserError:
    if "no longer any instances available" in text or "not available" in text.lower():
        return UserError(
            f"Runpod has no capacity for this request ({text}); try another --gpu-type, fewer --gpus or --cloud ALL"
        )
    return UserError(f"Runpod API: {text}")


def price_per_gpu_hour(gpu: dict, cloud: str) -> float | None:
    fields = {"SECURE": ["securePrice"], "COMMUNITY": ["communityPrice"], "ALL": ["communityPrice", "securePrice"]}
    prices = [gpu.get(f) for f in fields[cloud] if gpu.get(f)]
    return min(prices) if prices else None


def _pod_id(args) -> str:
    if args.pod:
        return args.pod
    if STATE.is_file():
        return io.read_json(STATE)["id"]
    raise UserError("no pod id: pass --pod ID (no pod was created from this folder)")


def up(args) -> int:
    rp = _sdk()
    gpu = _call(rp.get_gpu, args.gpu_type, args.gpus)
    if gpu.get("maxGpuCount") and args.gpus > gpu["maxGpuCount"]:
        raise UserError(f"--gpus {args.gpus}: a {gpu['displayName']} pod has at most {gpu['maxGpuCount']}")
    price = price_per_gpu_hour(gpu, args.cloud)
    cost = "price unknown" if price is None else f"${price:.2f}/GPU/h, about ${price * args.gpus:.2f}/h"
    print(
        f"{args.gpus} x {gpu.get('displayName', args.gpu_type)} ({args.cloud.lower()} cloud): {cost}, plus "
        f"{args.volume_gb} GB volume and {args.disk_gb} GB disk; image {args.image}"
    )
    if not args.yes and input("Create this pod? [y/N] ").strip().lower() not in ("y", "yes"):
        print("nothing created")
        return 1
    env = dict(kv.split("=", 1) for kv in args.env)
    env.update({"SDPIPE_TARGET": args.target} if args.target else {})
    pod = _call(
        rp.create_pod,
        args.name,
        args.image,
        args.gpu_type,
        cloud_type=args.cloud,
        gpu_count=args.gpus,
        volume_in_gb=args.volume_gb,
        container_disk_in_gb=args.disk_gb,
        volume_mount_path=WORKSPACE,
        ports="22/tcp",
        env=env,
        support_public_ip=True,
        start_ssh=True,
    )
    io.write_json(STATE, {"id": pod["id"], "gpus": args.gpus, "gpu_type": args.gpu_type, "image": args.image})
    print(f"created pod {pod['id']}; follow it with `sdpipe runpod status` and stop billing with `sdpipe runpod down`")
    return 0


def _ssh(pod: dict) -> tuple[str, int] | None:
    ports = ((pod.get("runtime") or {}).get("ports")) or []
    for p in ports:
        if p.get("privatePort") == 22 and p.get("isIpPublic"):
            return p["ip"], int(p["publicPort"])
    return None


def status(args) -> int:
    rp = _sdk()
    pod = _call(rp.get_pod, _pod_id(args))
    if not pod:
        raise UserError(f"no pod {_pod_id(args)} on this account")
    ssh = _ssh(pod)
    gpu = (pod.get("machine") or {}).get("gpuDisplayName", "?")
    print(
        f"pod {pod['id']} ({pod.get('name')}): {pod.get('desiredStatus')}, {pod.get('gpuCount')} x {gpu}, "
        f"${pod.get('costPerHr')}/h, up {pod.get('uptimeSeconds') or 0} s"
        + (f", ssh -p {ssh[1]} root@{ssh[0]}" if ssh else ", no SSH address yet")
    )
    return 0


def logs(args) -> int:
    pod_id = _pod_id(args)
    print(
        f"The container's output: https://www.runpod.io/console/pods/{pod_id} (Logs). Each rule's log, once SSH "
        f"is up (`sdpipe runpod status` prints the address): ssh -p PORT root@IP "
        f"'tail -F {WORKSPACE}/project/logs/*.log'"
    )
    return 0


def sync(args) -> int:
    rp = _sdk()
    pod = _call(rp.get_pod, _pod_id(args))
    ssh = _ssh(pod or {})
    if not ssh:
        raise UserError("the pod has no public SSH port yet; see `sdpipe runpod status`")
    cmd = [
        "rsync",
        "-az",
        "--partial",
        "-e",
        f"ssh -p {ssh[1]} -o StrictHostKeyChecking=accept-new",
        f"root@{ssh[0]}:{WORKSPACE}/project/results/",
        str(Path(args.dest) / "results") + "/",
    ]
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise UserError("rsync failed (see above); or push from the pod: ssh in and run `dvc push` to your remote")
    return 0


def down(args) -> int:
    rp = _sdk()
    pod_id = _pod_id(args)
    if args.terminate:
        if not args.yes and input(f"Terminate pod {pod_id} and delete its volume? [y/N] ").strip().lower() != "y":
            print("nothing terminated")
            return 1
        _call(rp.terminate_pod, pod_id)
        STATE.unlink(missing_ok=True)
        print(f"terminated pod {pod_id}: nothing is billed any more")
        return 0
    _call(rp.stop_pod, pod_id)
    print(
        f"stopped pod {pod_id}: GPU billing ended; its volume is kept (and billed) until "
        "`sdpipe runpod down --terminate`"
    )
    return 0


def run(args) -> int:
    return {"up": up, "status": status, "logs": logs, "sync": sync, "down": down}[args.action](args)
