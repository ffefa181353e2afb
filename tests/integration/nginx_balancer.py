"""A real nginx in front of tritonserver replicas (the scale-out rehearsal's L7 balancer).

Its config is generated into a folder of the caller's (prefix, pid, logs, temp paths all there),
nginx runs in the foreground as our child in its own process group, and stop() ends that group.
Three listeners: gRPC round robin, gRPC sticky (`hash $http_x_session_id consistent`: the same
session header always reaches the same replica while it lives), HTTP round robin.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from hsserve.triton.server import free_ports

SESSION_HEADER = "x-session-id"
TAG_HEADER = "x-soak-id"  # NOTE: a client's own request tag, logged so a test can see the replica
LOG_FORMAT = '"$msec|$http_x_soak_id|$http_x_session_id|$upstream_addr|$status|$grpc_status"'


def _upstream(name: str, ports: list[int], sticky: bool) -> str:
    # NOTE: max_fails=1: one refused connect takes a dead replica out for fail_timeout
    servers = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=30s;\n" for p in ports)
    hashing = f"    hash $http_{SESSION_HEADER.replace('-', '_')} consistent;\n" if sticky else ""
    return f"  upstream {name} {{\n{hashing}{servers}    keepalive 16;\n  }}\n"


def _grpc_server(port: int, upstream: str) -> str:
    # NOTE: gRPC streams live as long as generation does: read/send timeouts cover a long stream
    return (f"  server {{\n    listen 127.0.0.1:{port} http2;\n    location / {{\n"
            f"      grpc_pass grpc://{upstream};\n      grpc_read_timeout 600s;\n"
            f"      grpc_send_timeout 600s;\n      grpc_next_upstream error timeout;\n"
            f"    }}\n  }}\n")


def _http_server(port: int, upstream: str) -> str:
    # NOTE: unbuffered so generate_stream's server-sent events pass as they come
    return (f"  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n"
            f"      proxy_pass http://{upstream};\n      proxy_http_version 1.1;\n"
            f"      proxy_set_header Connection \"\";\n      proxy_buffering off;\n"
            f"      proxy_read_timeout 600s;\n    }}\n  }}\n")


def render_config(root: str, grpc_ports: list[int], http_ports: list[int],
                  listen: tuple[int, int, int]) -> str:
    """nginx.conf text: listen = (gRPC round robin, gRPC sticky, HTTP) ports."""
    temps = "".join(f"  {kind}_temp_path {root}/{kind};\n"
                    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;\n" if os.geteuid() == 0 else ""  # NOTE: workers write our root-owned tmp
    return (
        f"{user}daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\n"
        f"error_log {root}/error.log info;\nevents {{ worker_connections 1024; }}\n"
        f"http {{\n  log_format rehearsal {LOG_FORMAT};\n"
        f"  access_log {root}/access.log rehearsal;\n{temps}"
        # NOTE: a stream's grpc-status comes in trailers; one refused outright has it as a header
        "  map $upstream_trailer_grpc_status $grpc_status {\n"
        "    default $upstream_trailer_grpc_status; \"\" $upstream_http_grpc_status;\n  }\n"
        + _upstream("grpc_rr", grpc_ports, sticky=False)
        + _upstream("grpc_sticky", grpc_ports, sticky=True)
        + _upstream("http_rr", http_ports, sticky=False)
        + _grpc_server(listen[0], "grpc_rr") + _grpc_server(listen[1], "grpc_sticky")
        + _http_server(listen[2], "http_rr") + "}\n"
    )


@dataclass
class Balancer:
    process: subprocess.Popen
    root: str
    grpc_url: str
    sticky_grpc_url: str
    http_url: str

    def log_lines(self) -> list[dict]:
        """The access log: one dict per finished request (msec, tag, session, upstream, ...)."""
        keys = ("msec", "tag", "session", "upstream", "status", "grpc_status")
        with open(os.path.join(self.root, "access.log")) as f:
            return [dict(zip(keys, line.strip().split("|"))) for line in f if line.strip()]

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # NOTE: graceful: workers finish, then exit
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # NOTE: nginx leads its own process group: its workers are in it
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_balancer(root: str, grpc_ports: list[int], http_ports: list[int]) -> Balancer:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(binary):
        raise FileNotFoundError("nginx not found: scripts/setup.sh installs it (apt-get)")
    os.makedirs(root, exist_ok=True)
    listen = tuple(free_ports(3))
    conf = os.path.join(root, "nginx.conf")
    with open(conf, "w") as f:
        f.write(render_config(root, grpc_ports, http_ports, listen))
    log = open(os.path.join(root, "stdout.log"), "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen([binary, "-p", root, "-c", conf, "-e", f"{root}/error.log"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 20
    while not all(_listening(p) for p in listen):
        if proc.poll() is not None or time.time() > deadline:
            with open(os.path.join(root, "error.log")) as f:
                err = f.read()[-2000:]
            Balancer(proc, root, "", "", "").stop()
            raise RuntimeError(f"nginx did not start: {err}")
        time.sleep(0.05)
    return Balancer(proc, root, f"127.0.0.1:{listen[0]}", f"127.0.0.1:{listen[1]}",
                    f"127.0.0.1:{listen[2]}")
