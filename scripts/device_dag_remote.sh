#!/usr/bin/env bash
# Issue 30 on a GPU machine: the whole DAG (`sdpipe bench-dag`, through `snakemake --profile runpod`) from
# webdataset tar shards in a bucket of a loopback S3 server (moto), which prepare mirrors (data.raw_remote), its
# latent cache published to the same server, then training again with the local cache moved aside, every shard
# fetched from that server, as a second node would.
# Here: S3_SERVER=1 LEAN=1 scripts/device_wheels.sh. There, with .whl carried:
#   scripts/device_dag_remote.sh COMMIT "BENCH-DAG ARGS" ["BENCH-DAG ARGS" ...]
# Each argument is one bench-dag run (e.g. "--job tiny --name dag-tiny-tar-s3"); results, logs and the S3
# server's log land in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$1
shift
scripts/device_install.sh
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_DEFAULT_REGION=us-east-1
export AWS_ENDPOINT_URL=http://127.0.0.1:9000
python3 -m moto.server -H 127.0.0.1 -p 9000 > "$OUT/moto.log" 2>&1 &
for _ in $(seq 60); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', 9000), 1)" 2>/dev/null && break
  sleep 1
done
python3 -c "import boto3; boto3.client('s3').create_bucket(Bucket='bench')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for run in "$@"; do
  name=$(sed -E 's/.*--name ([^ ]+).*/\1/' <<< "$run")
  # shellcheck disable=SC2086  # each argument is a list of bench-dag options
  status=0
  sdpipe bench-dag --source . --layout tar --raw-remote "s3://bench/$name-raw" --latents-remote "s3://bench/$name" \
    --out "$OUT" --commit "$commit" --work "/tmp/dag-$name" $run || status=$?
  (cd "/tmp/dag-$name" && tar czf "$OUT/logs-$name.tgz" ./*/snakemake.log ./*/project/logs ./*/project/benchmarks \
    ./*/project/results/*/summary.json ./*/project/results/*/metrics.json) 2>/dev/null || true
  [ "$status" = 0 ] || exit "$status"
done
