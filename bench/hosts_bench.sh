#!/usr/bin/env bash
# SP groups that span hosts, measured: hosts simulated as network namespaces on one bridge, each
# joined to it by a veth pair rate-limited with tc (both directions), ranks host-contiguous as
# launchers place them. For each layout (hosts x ranks per host, root) one run of
# `spbcast_shm_worker hosts_bench` puts side by side one raw Gloo broadcast of the payload's
# bytes, spbcast's network path and spbcast's automatic choice (hierarchical here, also with
# the leader allocating its batch in shared memory): median time per batch and bytes over the
# links per batch (the veth counters) over the payload; then, in fresh processes for each, the
# group's memory while a batch is alive (`group_memory`: sum of Pss_Anon + change in Shmem).
# The namespaces share this machine's memory and CPUs; the byte counts show what crossed.
#
#   bench/hosts_bench.sh [path/to/spbcast_shm_worker]      (default: build/system/tests/)
#   RATE=1gbit PROFILE=qwen3-vl-image MICRO=3 REPEATS=3 LAYOUTS="2x2:0 2x2:3 2x4:0 2x4:7 3x2:0 4x2:0 4x2:3"
#   CHUNK=<bytes>: options.relay_chunk_bytes (default 4 MiB). MEMORY=0 skips the group memory.
#
# Needs root, ip(8) and tc(8); exits 77 where it cannot run. Cleans up after itself.
set -uo pipefail
cd "$(dirname "$0")/.."

WORKER="${1:-build/system/tests/spbcast_shm_worker}"
RATE="${RATE:-1gbit}"
PROFILE="${PROFILE:-qwen3-vl-image}"
MICRO="${MICRO:-3}"
REPEATS="${REPEATS:-3}"
LAYOUTS="${LAYOUTS:-2x2:0 2x2:3 2x4:0 2x4:7 3x2:0 4x2:0 4x2:3}"

skip() { echo "hosts_bench: SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip > /dev/null && command -v tc > /dev/null || skip "needs ip(8) and tc(8) (iproute2)"
[ -x "$WORKER" ] || { echo "hosts_bench: worker $WORKER not found (build spbcast_shm_worker)"; exit 1; }

ID=$$
BRIDGE="spbr$ID"
NAMESPACES=()
PIDS=()
WORK="$(mktemp -d /tmp/spbcast-hosts-bench.XXXXXX)"
cleanup() {
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2> /dev/null; done
    for ns in "${NAMESPACES[@]}"; do ip netns del "$ns" 2> /dev/null; done
    ip link del "$BRIDGE" 2> /dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ip link add "$BRIDGE" type bridge 2> "$WORK/err" || skip "no bridges here: $(cat "$WORK/err")"
ip link set "$BRIDGE" up

host() {  # <index>: namespace spbh<index>_<id> at 10.97.0.<index+1>, its link limited to $RATE
    local h=$1 ns="spbh${1}_$ID" inside="vh$1x$ID" outside="vb$1x$ID"
    ip netns add "$ns" || skip "cannot create a network namespace"
    NAMESPACES+=("$ns")
    ip link add "$inside" type veth peer name "$outside" || skip "no veth pairs here"
    ip link set "$inside" netns "$ns"
    ip link set "$outside" master "$BRIDGE" up
    ip -n "$ns" addr add "10.97.0.$((h + 1))/24" dev "$inside"
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$inside" up
    tc -n "$ns" qdisc add dev "$inside" root tbf rate "$RATE" burst 256kb latency 100ms || skip "tc cannot limit the link"
    tc qdisc add dev "$outside" root tbf rate "$RATE" burst 256kb latency 100ms
}
most=0
for layout in $LAYOUTS; do [ "${layout%%x*}" -gt $most ] && most=${layout%%x*}; done
for h in $(seq 0 $((most - 1))); do host "$h"; done

echo "hosts_bench: $(nproc) CPUs, links limited to $RATE, profile $PROFILE x $MICRO micro-batches, median of $REPEATS"
PORT=29600
status=0
launch() {  # <hosts> <ranks per host> <worker arguments...>: runs one group; rank 0's output
    local hosts=$1 per_host=$2 world=$(($1 * $2)) rank h counter
    shift 2
    PORT=$((PORT + 1))
    PIDS=()
    for rank in $(seq 0 $((world - 1))); do
        h=$((rank / per_host))
        counter=0
        [ $((rank % per_host)) = 0 ] && counter=1
        ip netns exec "spbh${h}_$ID" env MASTER_ADDR=10.97.0.1 MASTER_PORT=$PORT RANK=$rank WORLD_SIZE=$world \
            LOCAL_RANK=$((rank % per_host)) GLOO_SOCKET_IFNAME="vh${h}x$ID" HOST_COUNTER=$counter timeout 600 \
            "$WORKER" "$@" > "$WORK/rank$rank.log" 2>&1 &
        PIDS+=($!)
    done
    for rank in $(seq 0 $((world - 1))); do
        wait "${PIDS[$rank]}" || { status=1; echo "hosts_bench: rank $rank of $* failed:"; sed 's/^/  /' "$WORK/rank$rank.log"; }
    done
    cat "$WORK/rank0.log"
}
for layout in $LAYOUTS; do
    hosts=${layout%%x*}
    rest=${layout#*x}
    per_host=${rest%%:*}
    root=${layout#*:}
    label="$hosts hosts x $per_host ranks, root $root"
    launch "$hosts" "$per_host" hosts_bench "$PROFILE" "$MICRO" "$root" "$REPEATS" "${CHUNK:-4194304}" | sed -n "s/^hosts_bench | /$label | /p"
    # Group memory while a batch is alive, each in fresh processes (caches would hide it).
    [ "${MEMORY:-1}" = 0 ] && continue
    for mode in "network plain" "auto plain" "auto leader_allocates"; do
        set -- $mode
        launch "$hosts" "$per_host" group_memory "$PROFILE" "$MICRO" "$1" "$2" "$root" | sed -n "s/^group memory /$label | memory /p"
    done
done
exit $status
