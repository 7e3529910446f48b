#!/usr/bin/env bash
# One job across four "nodes" of this machine, and nodes that fail.
#
#   scripts/cluster-test.sh [AUTOTP] [WORKDIR]     (as root; default target/release/autotp)
#
# The nodes are network namespaces with their own host names (UTS namespaces) and addresses,
# joined by veth links to one bridge; mpirun runs on the first and starts its daemons on the
# others through a launch agent that enters their namespaces (in place of ssh), so the ranks
# talk over TCP between nodes as on a cluster. The GPT-2 fixture trains as tp 2 x dp 2, one
# rank per node:
#
#   1. across the nodes it trains bit for bit as the same plan's ranks as threads;
#   2. a hung rank (SIGSTOP) ends the job within --comm-timeout plus the probes, with a line
#      naming rank 3 and its host;
#   3. a killed rank ends the job, mpirun naming its rank and node;
#   4. a cut link (node 4's veth down) ends the job as a hung rank does; the last checkpoint
#      stays intact;
#   5. the job resumes on the two nodes left, as tp 2 (the checkpoint resharded) and follows
#      the uninterrupted run's losses within 1e-5 relative.
#
# Exits 0 when every check holds, 77 when namespaces cannot be made here (not root, no `ip`,
# `unshare` or `mpirun`), 1 at the first check that fails. tests/cluster.rs runs it.
#
# mpirun learns that a node is unreachable only when TCP gives up retransmitting to it
# (net.ipv4.tcp_retries2, 15 by default: about 15 minutes); the head node's namespace lowers it
# to 3 (a few seconds), as a cluster would that wants a lost node's job to end at once. The
# ranks themselves end within the timeout whatever it is.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
autotp="$(realpath "${1:-$repo/target/release/autotp}")"
work="${2:-$(mktemp -d)}"
mkdir -p "$work"
# A resumed run appends to its metrics: none may be left from an earlier run here.
rm -f "$work"/*.jsonl
timeout_s=5
# The most seconds from a fault to mpirun's end: the timeout, the probes, mpirun's own end
# (seen: 4 to 15 s on an idle machine; the margin is for a machine busy with other tests).
ended_within=45
nodes=4
prefix="atp$$"

skip() { echo "cluster-test: skipped: $*" >&2; exit 77; }
fail() { echo "cluster-test: FAILED: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || skip "network namespaces need root"
for tool in ip unshare mpirun; do command -v "$tool" >/dev/null || skip "no $tool"; done
[ -x "$autotp" ] || fail "no autotp executable at $autotp"

node() { echo "${prefix}n$1"; }
cleanup() {
  for i in $(seq "$nodes"); do
    if ip netns list | grep -qw "$(node "$i")"; then
      ip netns pids "$(node "$i")" | xargs -r kill -9 2>/dev/null || true
      ip netns delete "$(node "$i")"
    fi
    # The namespace may outlive its name while a socket in it closes; its link goes now.
    ip link delete "${prefix}v$i" 2>/dev/null || true
  done
  ip link delete "${prefix}br" 2>/dev/null || true
}
trap cleanup EXIT
make_nodes() {
  # Each step checked: `set -e` does not reach into a function called before `||`.
  ip link add "${prefix}br" type bridge && ip link set "${prefix}br" up || return 1
  for i in $(seq "$nodes"); do
    local n
    n="$(node "$i")"
    ip netns add "$n" \
      && ip link add "${prefix}v$i" type veth peer name eth0 netns "$n" \
      && ip link set "${prefix}v$i" master "${prefix}br" up \
      && ip -n "$n" addr add "10.231.0.$i/24" dev eth0 \
      && ip -n "$n" link set eth0 up \
      && ip -n "$n" link set lo up || return 1
  done
  ip netns exec "$(node 1)" sh -c 'echo 3 > /proc/sys/net/ipv4/tcp_retries2' \
    && ip netns exec "$(node 1)" unshare --uts true
}
# A machine (a container without CAP_SYS_ADMIN or CAP_NET_ADMIN) that cannot make the nodes
# skips the test; one that can must pass it.
make_nodes 2>"$work/make-nodes.txt" || skip "cannot make the nodes: $(head -1 "$work/make-nodes.txt")"
# Until every node reaches node 1: a connection to a closed port is refused at once when
# packets pass, and times out while a new link does not carry them yet.
for i in $(seq 2 "$nodes"); do
  for _ in $(seq 20); do
    rc=0
    ip netns exec "$(node "$i")" timeout 1 bash -c 'exec 3<>/dev/tcp/10.231.0.1/9' 2>/dev/null || rc=$?
    [ "$rc" -ne 124 ] && break
  done
  [ "$rc" -ne 124 ] || fail "node $i does not reach node 1 over its new link"
done

# Open MPI's launch agent, called as `agent HOST COMMAND...` (as it would call ssh).
cat > "$work/agent" <<'EOF'
#!/bin/sh
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
EOF
chmod +x "$work/agent"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tokens="$repo/tests/fixtures/train/tokens.bin"
# mpirun on node 1 over the first HOSTS nodes, one rank each: cluster_run HOSTS OUTPUT ARGS...
cluster_run() {
  local hosts="$1" output="$2"
  shift 2
  : > "$work/hosts"
  for i in $(seq "$hosts"); do echo "$(node "$i") slots=1" >> "$work/hosts"; done
  ip netns exec "$(node 1)" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$(node 1)" \
    mpirun --hostfile "$work/hosts" -n "$hosts" --mca plm_rsh_agent "$work/agent" \
    --mca oob_tcp_if_include 10.231.0.0/24 --mca btl_tcp_if_include 10.231.0.0/24 --mca btl tcp,self \
    "$autotp" run "$@" --data "$tokens" --log-every 1000 > "$output" 2>&1
}
losses() { grep -o '"loss":[^,}]*' "$1" | cut -d: -f2; }
compile() {
  "$autotp" compile "$repo/tests/fixtures/gpt2/model.onnx" --seq-len 32 --lr 2e-3 --grad-clip 1.0 "$@" > /dev/null 2>&1
}
compile --micro-batch 4 --tp 2 --dp 2 -o "$work/tp2-dp2.atp"
compile --micro-batch 8 --tp 2 -o "$work/tp2.atp"

echo "1. tp 2 x dp 2 across $nodes nodes against the same plan as threads"
cluster_run 4 "$work/healthy.txt" "$work/tp2-dp2.atp" --steps 8 --metrics-out "$work/healthy.jsonl" \
  || fail "the job across nodes failed: $(cat "$work/healthy.txt")"
"$autotp" run "$work/tp2-dp2.atp" --data "$tokens" --steps 8 --metrics-out "$work/threads.jsonl" > /dev/null 2>&1
[ "$(losses "$work/healthy.jsonl")" = "$(losses "$work/threads.jsonl")" ] \
  || fail "the losses across nodes differ from the threads' run"
echo "   8 steps, the same losses bit for bit"

# The process of rank 3 (node 4's autotp).
rank3_pid() {
  for pid in $(ip netns pids "$(node 4)"); do
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$autotp" ] && echo "$pid"
  done
}
# Starts a long job, waits for its first checkpoint, runs FAULT, and checks that the job ended
# within $ended_within s with a line containing each of the EXPECTED strings.
faulted() {
  local name="$1" fault="$2"
  shift 2
  rm -rf "$work/$name"
  cluster_run 4 "$work/$name.txt" "$work/tp2-dp2.atp" --steps 1000000 --save "$work/$name" --save-every 4 \
    --comm-timeout "$timeout_s" &
  local job=$!
  for _ in $(seq 600); do
    [ -e "$work/$name/latest" ] && break
    kill -0 "$job" 2>/dev/null || fail "$name: the job ended before its first checkpoint: $(cat "$work/$name.txt")"
    sleep 0.1
  done
  [ -e "$work/$name/latest" ] || fail "$name: no checkpoint within 60 s"
  eval "$fault"
  local start=$SECONDS
  while kill -0 "$job" 2>/dev/null; do
    [ $((SECONDS - start)) -le $((ended_within + 30)) ] || { kill "$job"; fail "$name: the job still runs"; }
    sleep 0.2
  done
  local took=$((SECONDS - start))
  ! wait "$job" || fail "$name: the job succeeded"
  [ "$took" -le "$ended_within" ] || fail "$name: the job ended $took s after the fault"
  for expected in "$@"; do
    grep -F -- "$expected" "$work/$name.txt" | grep -qF -- "$1" \
      || fail "$name: no line names '$expected': $(cat "$work/$name.txt")"
  done
  echo "   ended $took s after the fault: $(grep -F -- "$1" "$work/$name.txt" | head -1)"
}

# What a faulted job left on the nodes (a daemon of a job mpirun gave up on) goes.
clear_nodes() {
  for i in $(seq "$nodes"); do
    ip netns pids "$(node "$i")" | xargs -r kill -9 2>/dev/null || true
  done
}

# The link is cut last: a link brought back up may take a moment to carry packets again.
echo "2. rank 3 hung (SIGSTOP)"
faulted hung 'kill -STOP $(rank3_pid)' "rank 3 (host $(node 4), pid" "does not answer"
clear_nodes

echo "3. rank 3 killed"
faulted killed 'kill -KILL $(rank3_pid)' "process rank 3" "on node $(node 4)"
clear_nodes

echo "4. node 4's link cut"
faulted cut "ip link set ${prefix}v4 down" "rank 3 (host $(node 4), pid" "does not answer"

echo "5. the job resumed on the 2 nodes left, as tp 2"
step="$(cat "$work/cut/latest")"
step=$((10#${step#step-}))
cluster_run 2 "$work/resumed.txt" "$work/tp2.atp" --steps $((step + 6)) --resume "$work/cut" \
  --metrics-out "$work/resumed.jsonl" || fail "the resumed job failed: $(cat "$work/resumed.txt")"
grep -q "written by another parallel layout" "$work/resumed.txt" || fail "the checkpoint was not resharded"
"$autotp" run "$work/tp2-dp2.atp" --data "$tokens" --steps $((step + 6)) --metrics-out "$work/whole.jsonl" > /dev/null 2>&1
worst="$(paste <(losses "$work/whole.jsonl" | tail -n 6) <(losses "$work/resumed.jsonl") \
  | awk '{ d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n != 6) print "missing"; else printf "%.2e", w }')"
awk -v w="$worst" 'BEGIN { exit !(w != "missing" && w + 0 <= 1e-5) }' \
  || fail "the resumed losses differ from the uninterrupted run's: $worst relative"
echo "   from step $step, 6 steps within $worst relative of the uninterrupted run"

echo "cluster-test: passed"
