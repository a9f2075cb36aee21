#!/usr/bin/env bash
# A one-node Ceph with an S3 gateway, for tests: one monitor, one OSD on
# memstore, one radosgw on a loopback port, one S3 user. No systemd: every
# daemon runs in the foreground (-f) under this script's control and is
# stopped by its PID.
#
#   ceph.sh start DIR [PORT]   boot a cluster whose files live in DIR;
#                              prints AWS_* settings (also in DIR/env) and
#                              leaves the daemons' PIDs in DIR/pids
#   ceph.sh stop DIR           stop the daemons listed in DIR/pids
#   ceph.sh rgw-stop DIR       stop only the S3 gateway (the cluster and
#                              its data stay; its PID leaves DIR/pids)
#   ceph.sh rgw-start DIR      start the gateway again on the same port
#                              (its PID joins DIR/pids) and wait until it
#                              answers
#   ceph.sh check              exit 0 if the packages are installed, their
#                              daemons run and we are root; exit 2 with the
#                              reason when something is absent (the tests
#                              skip, or fail under CI=true); any other exit
#                              (a daemon's binary that does not run, a bug
#                              here) fails the tests everywhere
#
# Facts this relies on (Ceph 16.2, Debian 12): the monitor must listen on
# port 6789 (radosgw failed to authenticate with another one), so only one
# cluster runs on a machine at a time (start takes a lock on
# /run/zdisk-test-ceph.lock for the cluster's lifetime; stop releases it);
# `auth_*_required = none` still leaves S3 signatures checked; a
# single OSD needs pool size 1 and chooseleaf type 0; a paxos propose
# interval of 0.1 s brings bootstrap from about 18 s to a few seconds.
set -euo pipefail

need=(monmaptool ceph-mon ceph-osd ceph-mgr radosgw radosgw-admin ceph uuidgen curl)

check() {
    if [ "$(id -u)" != 0 ]; then
        echo "needs root (Ceph daemons run as root here)"
        return 2
    fi
    for tool in "${need[@]}"; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            echo "$tool is not installed (apt-get install ceph-mon ceph-osd ceph-mgr radosgw ceph-common uuid-runtime curl; .ci/run does)"
            return 2
        fi
    done
    # Installed but unable to start is a failure, not a skip.
    local daemon
    for daemon in ceph-mon ceph-osd ceph-mgr radosgw; do
        if ! "$daemon" --version >/dev/null 2>&1; then
            echo "$daemon is installed but does not run: $("$daemon" --version 2>&1 | tail -n 3)"
            return 1
        fi
    done
}

# Waits up to $1 seconds for the command that follows to succeed.
wait_for() {
    local limit=$1
    shift
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            return 1
        fi
        sleep 0.1
    done
}

# Boots the monitor, the OSD and the manager in DIR for radosgw on PORT.
# Run in a subshell with `set -e`; exits 3 if the monitor refused the OSD
# for a zero fsid. Now and then (one boot in three or four on a busy
# machine) a client of the monitor sends a command before it has the
# monitor map, with a zero fsid, and the monitor answers "wrong fsid"
# (EPERM): the ceph CLI then fails once, but an OSD never comes up, nor
# does a new OSD process on the same cluster. A fresh cluster then boots.
boot_cluster() {
    local dir=$1 port=$2
    local fsid conf=$dir/ceph.conf
    fsid=$(uuidgen)
    mkdir -p "$dir/mon" "$dir/osd" "$dir/mgr" "$dir/rgw" "$dir/run" "$dir/log"
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = 127.0.0.1:6789
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
osd crush chooseleaf type = 0
paxos propose interval = 0.1
mon warn on pool no redundancy = false
run dir = $dir/run
log file = $dir/log/\$name.log
admin socket = $dir/run/\$name.asok
keyring = $dir/keyring
[mon]
mon data = $dir/mon/\$cluster-\$id
mon osd full ratio = 0.99
mon osd nearfull ratio = 0.98
[osd]
osd data = $dir/osd/\$cluster-\$id
osd objectstore = memstore
memstore device bytes = 4294967296
osd max object size = 1073741824
[mgr]
mgr data = $dir/mgr/\$cluster-\$id
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$port
rgw data = $dir/rgw
rgw dns name = 127.0.0.1
EOF
    : >"$dir/keyring"
    local ceph=(ceph -c "$conf")

    monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:6789]" "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" -f -i a >"$dir/log/mon.out" 2>&1 &
    echo $! >>"$dir/pids"
    if ! wait_for 30 "${ceph[@]}" --connect-timeout 2 mon stat; then
        echo "the monitor did not come up (see $dir/log)" >&2
        return 1
    fi

    local osd_uuid osd_id
    osd_uuid=$(uuidgen)
    osd_id=$("${ceph[@]}" osd new "$osd_uuid")
    mkdir -p "$dir/osd/ceph-$osd_id"
    ceph-osd -c "$conf" -i "$osd_id" --mkfs --osd-uuid "$osd_uuid" >/dev/null 2>&1
    ceph-mgr -c "$conf" -f -i a >"$dir/log/mgr.out" 2>&1 &
    echo $! >>"$dir/pids"
    osd_up() { "${ceph[@]}" osd stat | grep -q '1 up'; }
    refused() { grep -qs "wrong fsid" "$dir/log/osd.out" "$dir/log/osd.$osd_id.log"; }
    ceph-osd -c "$conf" -f -i "$osd_id" >"$dir/log/osd.out" 2>&1 &
    echo $! >>"$dir/pids"
    up_or_refused() { refused || osd_up; }
    if wait_for 60 up_or_refused; then
        if refused; then
            exit 3
        fi
        return 0
    fi
    echo "the OSD did not come up (see $dir/log)" >&2
    tail -n 5 "$dir/log/osd.out" "$dir/log/osd.$osd_id.log" "$dir/log/mon.a.log" >&2 || true
    exit 1
}

# Stops every daemon in DIR/pids but the lock holder (the first line).
stop_daemons() {
    local dir=$1 pid
    for pid in $(tail -n +2 "$dir/pids" | tac); do
        kill -9 "$pid" 2>/dev/null || true
        while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    done
    head -n 1 "$dir/pids" >"$dir/pids.new"
    mv "$dir/pids.new" "$dir/pids"
}

start() {
    local dir=$1 port=${2:-}
    check
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ -z "$port" ]; then
        port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    fi
    # One cluster at a time: the monitor's port is fixed. The lock is held
    # by a sleeping child whose PID joins the others, so stop releases it.
    exec 9>/run/zdisk-test-ceph.lock
    if ! flock -w 900 9; then
        echo "another test cluster held /run/zdisk-test-ceph.lock for 900 s" >&2
        exit 1
    fi
    : >"$dir/pids"
    sleep infinity </dev/null >/dev/null 2>&1 &
    echo $! >>"$dir/pids"
    exec 9>&-

    local attempt rc conf=$dir/ceph.conf
    for attempt in 1 2 3; do
        set +e
        (
            set -e
            boot_cluster "$dir" "$port"
        )
        rc=$?
        set -e
        if [ "$rc" = 0 ]; then
            break
        fi
        stop_daemons "$dir"
        if [ "$attempt" = 3 ]; then
            echo "the cluster did not boot in three attempts (see $dir/log)" >&2
            exit 1
        fi
        if [ "$rc" = 3 ]; then
            echo "the monitor refused the OSD for a zero fsid (attempt $attempt); booting a fresh cluster" >&2
        else
            echo "the cluster did not boot (attempt $attempt); booting a fresh one" >&2
        fi
        rm -rf "$dir/mon" "$dir/osd" "$dir/mgr" "$dir/rgw" "$dir/run" "$dir/monmap"
        mkdir -p "$dir/log/attempt-$attempt"
        mv "$dir"/log/*.* "$dir/log/attempt-$attempt/" 2>/dev/null || true
    done

    echo "$port" >"$dir/rgw.port"
    rgw_start "$dir"

    local access secret
    access=ZDISK$(uuidgen | tr -d - | cut -c1-15 | tr a-z A-Z)
    secret=$(uuidgen | tr -d -)$(uuidgen | tr -d - | cut -c1-8)
    radosgw-admin -c "$conf" user create --uid=zdisk --display-name=zdisk \
        --access-key="$access" --secret="$secret" >/dev/null
    cat >"$dir/env" <<EOF
AWS_ENDPOINT_URL=http://127.0.0.1:$port
AWS_ALLOW_HTTP=true
AWS_ACCESS_KEY_ID=$access
AWS_SECRET_ACCESS_KEY=$secret
AWS_REGION=us-east-1
EOF
    cat "$dir/env"
}

# Starts radosgw on the port start chose; its PID goes to DIR/rgw.pid and
# DIR/pids (so stop still ends it).
rgw_start() {
    local dir=$1 port
    port=$(cat "$dir/rgw.port")
    if [ -f "$dir/rgw.pid" ] && kill -0 "$(cat "$dir/rgw.pid")" 2>/dev/null; then
        echo "radosgw already runs (PID $(cat "$dir/rgw.pid"))" >&2
        exit 1
    fi
    radosgw -c "$dir/ceph.conf" -f -n client.rgw.a >>"$dir/log/rgw.out" 2>&1 &
    echo $! >"$dir/rgw.pid"
    echo $! >>"$dir/pids"
    if ! wait_for 60 curl -sf "http://127.0.0.1:$port/"; then
        echo "radosgw did not answer on port $port (see $dir/log)" >&2
        exit 1
    fi
}

# Stops radosgw alone and waits until its port refuses connections.
rgw_stop() {
    local dir=$1 pid port
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/rgw.pid" ] || {
        echo "no radosgw PID in $dir/rgw.pid" >&2
        exit 1
    }
    pid=$(cat "$dir/rgw.pid")
    port=$(cat "$dir/rgw.port")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    grep -vx "$pid" "$dir/pids" >"$dir/pids.new" || true
    mv "$dir/pids.new" "$dir/pids"
    rm -f "$dir/rgw.pid"
    if curl -s -o /dev/null "http://127.0.0.1:$port/"; then
        echo "something still answers on port $port after radosgw stopped" >&2
        exit 1
    fi
}

stop() {
    local dir=$1 pid
    [ -f "$dir/pids" ] || return 0
    # Gateway, manager, OSD, monitor, then the lock holder: the reverse of start.
    for pid in $(tac "$dir/pids"); do
        kill "$pid" 2>/dev/null || true
    done
    for pid in $(tac "$dir/pids"); do
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -f "$dir/pids"
}

case "${1:-}" in
start) start "${2:?usage: ceph.sh start DIR [PORT]}" "${3:-}" ;;
stop) stop "${2:?usage: ceph.sh stop DIR}" ;;
rgw-stop) rgw_stop "${2:?usage: ceph.sh rgw-stop DIR}" ;;
rgw-start) rgw_start "$(cd "${2:?usage: ceph.sh rgw-start DIR}" && pwd)" ;;
check) check ;;
*)
    echo "usage: ceph.sh start DIR [PORT] | stop DIR | rgw-stop DIR | rgw-start DIR | check" >&2
    exit 64 # not 2, which check keeps for "absent"
    ;;
esac
