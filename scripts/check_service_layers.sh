#!/usr/bin/env bash
# Checks the layering of kvcompd's sources by their #include lines:
# - service/: only the data-plane facade (service/src/data_plane.cc) includes the transport's
#   headers (kvcomp/transport/*: wire messages, server, buffers); the assembler, engine, cache
#   repository, cache service and the control plane work on the service's own types;
# - transport/: never includes the kernels, storage or service (it moves bytes and checks them
#   against the wire protocol, and knows nothing of compression or where caches are kept);
# - storage/: never includes the kernels, the codecs, the transport or the service (it keeps keys
#   and bytes; what codec data means lives in codecs/, beside the engine).
#   bash scripts/check_service_layers.sh [repository root]   (a ctest: service_layering_check)
set -uo pipefail
root="${1:-$(dirname "$0")/..}"
cd "$root" || exit 2

facade="service/src/data_plane.cc"
status=0

if [ ! -f "$facade" ] || ! grep -qE '^\s*#\s*include\s+"kvcomp/transport/' "$facade"; then
  echo "check_service_layers: $facade is missing or does not include the transport" >&2
  status=1
fi

# The GPU channel (service/src/gpu_channel.cc) is the data plane's second entry, for payloads in
# GPU memory: it alone may include the transport's GPU link and the payload links' choice. The
# device environment (service/src/device_env.cc) takes its raw device memory from the GPU link's
# CUDA wrapper.
hits=$(grep -rnE '^\s*#\s*include\s+[<"]kvcomp/transport/' service tests/service 2>/dev/null |
       grep -v "^$facade:" |
       grep -vE '^service/src/gpu_channel\.cc:[0-9]+:#include "kvcomp/transport/(gpu|payload)_link\.h"' |
       grep -vE '^service/src/device_env\.cc:[0-9]+:#include "kvcomp/transport/gpu_link\.h"' || true)
if [ -n "$hits" ]; then
  echo "check_service_layers: transport headers included outside the data-plane facade ($facade):" >&2
  echo "$hits" >&2
  status=1
fi

hits=$(grep -rnE '^\s*#\s*include\s+[<"]kvcomp/(kernels|storage|service|decode)/' transport || true)
if [ -n "$hits" ]; then
  echo "check_service_layers: the transport includes compression, storage or service headers:" >&2
  echo "$hits" >&2
  status=1
fi

hits=$(grep -rnE '^\s*#\s*include\s+[<"]kvcomp/(kernels|codecs|transport|service|decode)/' storage || true)
if [ -n "$hits" ]; then
  echo "check_service_layers: the storage includes compression, codec, transport or service headers:" >&2
  echo "$hits" >&2
  status=1
fi

[ "$status" -eq 0 ] && echo "check_service_layers: ok"
exit "$status"
