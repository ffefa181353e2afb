"""Find and start a real tritonserver on a model repository.

A system `tritonserver` (the NGC image) is used when present; otherwise the binary shipped in the
`nvidia-pytriton` wheel, with its Python backend and the stub for the running interpreter copied
into a backend directory, and the library path set so the stub loads this interpreter's libpython.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

ADMIN_HEADER = "hsserve-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER  # NOTE: the gRPC endpoint's name for it
ADMIN_KEY_ENV = "HSSERVE_ADMIN_KEY"  # NOTE: its value, or a random one per start
RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]
    backend_dir: str | None = None  # a temp dir we made (removed on stop)
    admin_key: str = ""  # the ADMIN_HEADER value the restricted APIs ask for ("" = not ours)


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def free_ports(n: int = 3) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _pytriton_root() -> str | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "tritonserver")


def _python_backend_dir(root: str) -> str:
    """backends/python from the wheel plus the stub for this Python, in a fresh temp dir."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = os.path.join(root, "python_backend_stubs", version, "triton_python_backend_stub")
    if not os.path.exists(stub):
        raise FileNotFoundError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    out = tempfile.mkdtemp(prefix="hsserve-backends-")
    python_dir = os.path.join(out, "python")
    shutil.copytree(os.path.join(root, "backends", "python"), python_dir)
    shutil.copy(stub, python_dir)
    return out


def server_command(
    model_repository: str,
    ports: Ports,
    extra_args: list[str] | None = None,
    exit_timeout_s: int = 30,
) -> ServerCommand:
    env = dict(os.environ)
    # NOTE: the stub runs `python` from PATH to find its site-packages: this interpreter first
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    args = [
        f"--model-repository={os.path.abspath(model_repository)}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        f"--exit-timeout-secs={exit_timeout_s}",
        "--log-info=true",
        *(extra_args or []),
    ]
    if not any(a.startswith("--model-control-mode") for a in args):
        # NOTE: explicit control lets a model whose engine died unload itself (become unready)
        args.append("--model-control-mode=explicit")
        if not any(a.startswith("--load-model") for a in args):
            args.append("--load-model=*")
    admin_key = ""
    if not any(a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for a in args):
        # NOTE: explicit control makes the repository API live (a load may carry a model.py):
        # it and the other operator APIs answer only requests carrying the admin header
        admin_key = os.environ.get(ADMIN_KEY_ENV) or secrets.token_hex(16)
        rule = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={admin_key}"
        args += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
    system = shutil.which("tritonserver")
    if system:
        return ServerCommand([system, *args], env, admin_key=admin_key)
    root = _pytriton_root()
    if root is None:
        raise FileNotFoundError(
            "no tritonserver found: install nvidia-pytriton==0.7.0 or run inside the NGC image"
        )
    backend_dir = _python_backend_dir(root)
    libs = os.path.join(os.path.dirname(root), "..", "nvidia_pytriton.libs")
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, os.path.abspath(libs), env.get("LD_LIBRARY_PATH", "")) if p
    )
    binary = os.path.join(root, "bin", "tritonserver")
    return ServerCommand([binary, *args, f"--backend-directory={backend_dir}"], env, backend_dir,
                         admin_key)


@dataclass
class RunningServer:
    process: subprocess.Popen
    ports: Ports
    command: ServerCommand
    log_path: str | None = None
    _closed: bool = field(default=False, repr=False)

    @property
    def admin_key(self) -> str:
        return self.command.admin_key

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def wait_ready(self, timeout: float = 300.0, models: tuple[str, ...] = ("llm",)) -> None:
        """Until the server and `models` answer ready (plain HTTP: no client library needed)."""
        paths = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in models)]
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}{self._tail()}")
            if all(self._http_ok(p) for p in paths):
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout}s{self._tail()}")

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):  # NOTE: not listening yet, or 400: not ready
            return False

    def _tail(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "\n--- server log tail ---\n" + "".join(f.readlines()[-40:])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (Triton's graceful shutdown), then SIGKILL after `timeout`; then whatever is
        left of its process group (stubs) is killed too."""
        if self._closed:
            return self.process.returncode
        self._closed = True
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        try:  # NOTE: the server leads its own process group (start_server); stubs are in it
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.command.backend_dir:
            shutil.rmtree(self.command.backend_dir, ignore_errors=True)
        return self.process.returncode


def start_server(
    model_repository: str,
    ports: Ports | None = None,
    log_path: str | None = None,
    extra_args: list[str] | None = None,
    exit_timeout_s: int = 30,
) -> RunningServer:
    ports = ports or Ports(*free_ports(3))
    cmd = server_command(model_repository, ports, extra_args, exit_timeout_s)
    out = open(log_path, "w") if log_path else None  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        cmd.argv, env=cmd.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    return RunningServer(proc, ports, cmd, log_path)
