#!/bin/bash
# The walls between modules (ARCHITECTURE.md "Walls that must hold"), checked on the
# sources' #include lines: prints every include that crosses one, and fails if any does.
# The library's modules are src/*; the simulator (sim/) and the tools (apps/) are hosts.
# Usage: walls.sh <project directory>
set -u
root=${1:?usage: walls.sh <project directory>}
cd "$root/src" || exit 2
status=0

# A module that is not there would pass every check below: refuse it instead.
for m in common util protocol topology layout transfer control decode prefill metaserver connector ../sim ../apps; do
  [ -d "$m" ] || { echo "walls.sh: $root/src has no module $m"; status=1; }
done
[ -d sim ] && { echo "walls.sh: the simulator is a host of its own, at sim/, not src/sim"; status=1; }

# The includes of module $1 that match the extended regex $2, as "file:line: include".
includes_matching() {
  grep -rnE "^#include [\"<]($2)" "$1" --include='*.h' --include='*.cc' 2>/dev/null
}

# Module $1 may include no header matching $2; $3 says which wall that is.
forbid() {
  local found
  found=$(includes_matching "$1" "$2")
  if [ -n "$found" ]; then
    echo "$3:"
    echo "$found" | sed 's/^/  /'
    status=1
  fi
}

# Module $1 may include, of the project's own headers, only those under the directories
# listed in $2 (space-separated); $3 says which wall that is.
only() {
  local allowed found
  allowed=$(echo "$2" | sed -E 's# +#|#g')
  found=$(grep -rnE '^#include "' "$1" --include='*.h' --include='*.cc' |
          grep -vE "#include \"($allowed)/")
  if [ -n "$found" ]; then
    echo "$3:"
    echo "$found" | sed 's/^/  /'
    status=1
  fi
}

for pure in protocol topology layout; do
  only "$pure" "$pure common rd2h" "$pure is pure: only its own headers, common/ and the public ones"
  forbid "$pure" 'ucp/|ucs/|zmq|thread>|httplib' "$pure is pure: no sockets, threads or UCX"
done
forbid transfer '"(control|protocol|layout|decode|prefill|connector|metaserver|sim)/' \
  "transfer moves byte ranges: it knows nothing of layers, requests, KV or the control plane"
forbid transfer 'zmq' "transfer knows nothing of ZeroMQ"
forbid control '"transfer/|ucp/|ucs/' "control knows nothing of UCX"
for below in common util protocol topology layout transfer control decode prefill metaserver; do
  forbid "$below" '"(connector|sim)/' "nothing below connector includes connector or sim"
done
only util "util rd2h" "util is not the connector: only its own headers and the public ones"
only ../sim "sim util rd2h" "sim reaches rd2h only through include/rd2h (and util/, its own code)"
# The tools use the public face, util/ and the simulator; the benchmarks and wire tools that
# drive one module on its own name the headers they take from it here.
found=$(grep -rnE '^#include "' ../apps --include='*.h' --include='*.cc' |
        grep -vE '#include "(rd2h|util|sim)/' |
        grep -vE '#include "(decode/worker|prefill/worker|control/channel|control/curve|transfer/ucx_handles|transfer/ucx_link|common/msgpack_util|protocol/msgpack_field)\.h"' |
        grep -vE '#include "[a-z_]+\.h"')
if [ -n "$found" ]; then
  echo "apps uses the public face, util/ and sim/, and only the module headers listed here:"
  echo "$found" | sed 's/^/  /'
  status=1
fi

[ "$status" -eq 0 ] && echo "every wall holds"
exit "$status"
