#!/usr/bin/env bash
# Run a job longer than one device call (600 s): start it in its own process session, which outlives the call while
# the machine stays warm (30 s after a call), and collect it with a second call chained at once.
#   scripts/device_bg.sh start SECONDS DIR CMD...   start CMD (its output in DIR/job.log, its exit status in
#                                                   DIR/rc), then wait up to SECONDS, tarring DIR into
#                                                   $OUT/partial.tgz every 30 s so a cut call still returns it
#   scripts/device_bg.sh collect SECONDS DIR        wait up to SECONDS more for DIR/rc, then the same tar
# Put whatever should come back (results, logs) under DIR; one tar, since a call returns only a few files.
set -uo pipefail
mode=$1 limit=$2 dir=$3
shift 3
mkdir -p "$dir"
if [ "$mode" = start ]; then
  setsid nohup bash -c '"$@" > "$0/job.log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" > /dev/null 2>&1 < /dev/null &
fi
t0=$(date +%s)
while [ ! -f "$dir/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
  sleep 30
  tar czf "$OUT/partial.tgz" -C "$(dirname "$dir")" "$(basename "$dir")" 2>/dev/null
done
tar czf "$OUT/partial.tgz" -C "$(dirname "$dir")" "$(basename "$dir")"
cat "$dir/rc" 2>/dev/null || echo "still running after ${limit} s"
tail -5 "$dir/job.log"
