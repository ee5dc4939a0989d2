#!/usr/bin/env bash
# The HAProxy that Serve's HAProxy ingress starts (RAY_SERVE_ENABLE_HA_PROXY=1). Serve runs
# RAY_SERVE_HAPROXY_BINARY_PATH, this script (deployments/proxy_edge.py:haproxy_environment sets it and
# the SPECDEC_HAPROXY_* below; ./run serve uses it), as `haproxy -db -f CONFIG [-dR] [-sf PIDS -x SOCKET]`.
# It runs the real binary (SPECDEC_HAPROXY_BINARY) on a copy of Serve's config, with three changes:
#
# - every listener on SPECDEC_HAPROXY_HOST (the service's host). Serve's template binds HAProxy's stats
#   page (`bind *:8404`) and its Prometheus exporter (`bind :9101`) to every interface, without
#   authentication (SECURITY.md: nothing listens beyond the service's host);
# - the edge's header timeout (`timeout http-request`, deployments/proxy_edge.py): Serve's template has
#   none, so a client that never finishes its headers would hold a connection for `timeout client` (an
#   hour);
# - HAProxy gets SIGTERM when the process that started it (Serve's HAProxyManager actor) dies, e.g. on
#   `ray stop --force`: else it outlives the cluster and keeps the service's port.
#
# The pid stays the one Serve started (exec): Serve signals it (-sf reloads, soft stops).
set -euo pipefail

real=${SPECDEC_HAPROXY_BINARY:?the HAProxy binary to run}
host=${SPECDEC_HAPROXY_HOST:?the host every listener binds}
timeout_ms=${SPECDEC_HAPROXY_HEADER_TIMEOUT_MS:?the header timeout}
defaults="    timeout http-request ${timeout_ms}"

args=()
while [ $# -gt 0 ]; do
    if [ "$1" = -f ] && [ $# -ge 2 ]; then
        edge="${2%.cfg}.edge.cfg"
        # `bind *:P`, `bind :P`, `bind 0.0.0.0:P` -> `bind HOST:P`; the edge's settings after `defaults`.
        sed -E -e "s/^([[:space:]]*bind[[:space:]]+)(\*|0\.0\.0\.0)?:([0-9]+)/\1${host}:\3/" \
            -e "s|^defaults\$|defaults\n${defaults}|" "$2" > "$edge"
        args+=(-f "$edge")
        shift 2
    else
        args+=("$1")
        shift
    fi
done

# prctl(PR_SET_PDEATHSIG, SIGTERM) holds across exec; the interpreter is the cluster's own (no setpriv needed).
exec "${SPECDEC_PYTHON:?the Python that sets the parent-death signal}" -c '
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
os.execv(sys.argv[1], sys.argv[1:])' "$real" "${args[@]}"
