#!/bin/bash
# What one request costs a lab agent: N requests of one path sent back to back over one HTTP/2
# connection with the control service's certificate, and the agent's CPU (every thread, from the
# scheduler's clock) before and after, per request. Requests one after another keep the agent's
# caches warm and its threads awake: this is a request's own work, not the wake-up that a request
# arriving alone pays (compare `bench/agent_phases.py`'s idle figure).
#
#     sudo bench/agent_request_cost.sh PATH [METHOD] [BODY]     e.g. /host, /vms, /lease
#     environment: N (300), HOST (1: host1's agent); the lab must be up (`ferry lab up`)
set -euo pipefail
path=${1:?usage: agent_request_cost.sh PATH [METHOD] [BODY]}
method=${2:-GET}
body=${3:-}
n=${N:-300}
host=${HOST:-1}
lab=/run/ferry/lab
pki=$lab/pki/control
pid=$(cat "$lab/host$host/agent.pid")
url=$(python3 -c "import tomllib; print(tomllib.load(open('$lab/host$host/agent.toml', 'rb'))['url'])")
args=()
for _ in $(seq "$n"); do args+=("$url/api/v1$path" -o /dev/null); done
extra=()
if [ "$method" != GET ]; then
    extra=(-X "$method" -H 'content-type: application/json' -d "$body")
fi
cpu() { awk '{s += $1} END {print s}' /proc/"$pid"/task/*/schedstat; }
before=$(cpu)
codes=$(curl -s --http2 --cacert "$pki/ca-cert.pem" --cert "$pki/client-cert.pem" \
        --key "$pki/client-key.pem" "${extra[@]}" -w '%{http_code}\n' "${args[@]}" | sort | uniq -c)
after=$(cpu)
if [ "$(echo "$codes" | awk '{print $2}')" != 200 ]; then
    echo "agent_request_cost: not every answer was 200:" >&2
    echo "$codes" >&2
    exit 1
fi
echo "$method $path on host$host: $(( (after - before) / n / 1000 )) µs of the agent's CPU per request ($n requests)"
