#!/usr/bin/env bash
# Verbs for real without an RDMA NIC: Soft-RoCE (the rdma_rxe kernel module) gives a real verbs device over an Ethernet
# interface. This script, as root, where the module loads:
#   - joins two network namespaces (two "hosts") with a veth pair, 10.77.0.1 and 10.77.0.2;
#   - adds rxe0 on the first end and rxe1 on the second (`rdma link add rxe0 type rxe netdev IFACE`);
#   - runs the verbs tests (tests/test_verbs.py uses an rxe device where one exists) and
#     `tinyhet bench transfer --transports verbs --quick` in the first namespace, over rxe0;
#   - tears everything down on exit (trap), also after a failure or Ctrl-C.
# Where rdma_rxe does not load (no RDMA in this kernel, no permission) it says so in one line and exits with status 3.
# Exit status: 0 tests and bench passed, 1 one of them failed, 2 the setup failed, 3 no rdma_rxe here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TAG=${SOFTROCE_TAG:-thrxe}
A=${TAG}a B=${TAG}b

if [ ! -d /sys/module/rdma_rxe ]; then
  if ! command -v modprobe >/dev/null; then out="modprobe is missing (kmod), and the module is not loaded"
  elif [ ! -d "/lib/modules/$(uname -r)" ]; then out="this system has no /lib/modules/$(uname -r) (a container without the host's modules)"
  else out=$(modprobe rdma_rxe 2>&1) && out=""
  fi
  if [ -n "$out" ] || [ ! -d /sys/module/rdma_rxe ]; then
    echo "softroce: the rdma_rxe module does not load on this kernel ($(uname -r)): ${out:-modprobe gave no reason}; no Soft-RoCE here"
    exit 3
  fi
fi
for tool in ip rdma; do
  command -v $tool >/dev/null || { echo "softroce: '$tool' is missing (iproute2: apt-get install iproute2)"; exit 2; }
done

cleanup() {
  ip netns exec "$A" rdma link delete rxe0 2>/dev/null
  ip netns exec "$B" rdma link delete rxe1 2>/dev/null
  ip netns del "$A" 2>/dev/null
  ip netns del "$B" 2>/dev/null
}
trap cleanup EXIT INT TERM
cleanup

step() { "$@" || { echo "softroce: setup failed at: $*"; exit 2; }; }
step ip netns add "$A"
step ip netns add "$B"
step ip link add "${TAG}x" netns "$A" type veth peer name "${TAG}y" netns "$B"
step ip -n "$A" addr add 10.77.0.1/24 dev "${TAG}x"
step ip -n "$B" addr add 10.77.0.2/24 dev "${TAG}y"
for ns in "$A" "$B"; do step ip -n "$ns" link set lo up; done
step ip -n "$A" link set "${TAG}x" up
step ip -n "$B" link set "${TAG}y" up
step ip netns exec "$A" rdma link add rxe0 type rxe netdev "${TAG}x"
step ip netns exec "$B" rdma link add rxe1 type rxe netdev "${TAG}y"
ip netns exec "$A" rdma link show

status=0
echo "softroce: verbs tests over rxe0"
ip netns exec "$A" "$PY" -m pytest -q -rs tests/test_verbs.py || status=1      # the tests pick an rxe device themselves
echo "softroce: tinyhet bench transfer --transports verbs over rxe0"
ip netns exec "$A" env TINYHET_RDMA_DEVICE=rxe0 "$PY" -m tinyhet bench transfer --transports verbs --quick || status=1
exit $status
