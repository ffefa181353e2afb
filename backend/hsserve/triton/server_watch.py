"""Is the Triton server that runs us stopping? Read from its own HTTP liveness endpoint.

Triton unloads a decoupled model only after the model's in-flight requests have ended, and tells
the model nothing before that: on SIGTERM it waits, then gives up at --exit-timeout-secs. So the
adapter asks the server itself. The stub's parent is tritonserver; its command line gives the
HTTP port. On SIGTERM Triton closes its HTTP endpoint at once (seen: connection refused within
0.5 s) and only then waits; so "not live" (Triton answers an error while exiting), or a refused
connection where the endpoint answered before, means stopping. A timeout (a busy server) or an
endpoint never reached (HTTP disabled) means nothing, so a slow server is never mistaken for a
stopping one.
NOTE: liveness, not readiness: /v2/health/ready is also false while any model is loading or
unloading (seen: while a model whose engine died unloads), which is no reason to stop serving.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request


def http_live_url(pid: int | None = None) -> str | None:
    """http://127.0.0.1:<port>/v2/health/live of the parent tritonserver, None if unknown."""
    pid = os.getppid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    if not args or not os.path.basename(args[0]).startswith("tritonserver"):
        return None
    port, allowed = "8000", True
    for i, a in enumerate(args):
        key, _, value = a.partition("=")
        if not value and i + 1 < len(args):
            value = args[i + 1]
        if key == "--http-port":
            port = value
        elif key == "--allow-http":
            allowed = value.lower() not in ("false", "0")
    return f"http://127.0.0.1:{port}/v2/health/live" if allowed else None


class ServerWatch:
    def __init__(self, url: str | None):
        self.url = url
        self._answered = False  # NOTE: a refusal counts only after the endpoint once answered

    def stopping(self, timeout_s: float = 0.5) -> bool:
        if self.url is None:
            return False
        try:
            with urllib.request.urlopen(self.url, timeout=timeout_s) as r:
                self._answered = True
                return r.status != 200
        except urllib.error.HTTPError as e:
            self._answered = True
            return e.code != 200  # Triton answers 400 while exiting
        except urllib.error.URLError as e:
            refused = isinstance(e.reason, (ConnectionRefusedError, ConnectionResetError))
            return refused and self._answered
        except (ConnectionRefusedError, ConnectionResetError):
            return self._answered
        except OSError:
            return False
