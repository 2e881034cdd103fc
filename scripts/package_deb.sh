#!/usr/bin/env bash
# Builds kvcompd's Debian package from a build directory: /usr/bin/kvcompd (stripped),
# /etc/kvcomp/kvcompd.yaml (every option at its default, the data directory under
# /var/lib/kvcomp; a conffile), a systemd unit (kvcompd.service: DynamicUser, StateDirectory
# /var/lib/kvcomp, SIGHUP reloads tokens) and the docs. Depends: the Debian packages that own
# the shared libraries kvcompd links (dpkg-shlibdeps); libraries outside Debian's packages (the
# CUDA runtime from /usr/local/cuda) are listed in the description, not as dependencies. No
# maintainer scripts.
#   bash scripts/package_deb.sh [build-dir] [out-dir]      -> out-dir/kvcompd_<version>_<arch>.deb
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=$(cd "${1:-build}" && pwd)
OUT=$(mkdir -p "${2:-$BUILD/deb}" && cd "${2:-$BUILD/deb}" && pwd)
BIN=$BUILD/service/kvcompd
[ -x "$BIN" ] || { echo "package_deb: $BIN is not built (cmake --build $BUILD --target kvcompd)" >&2; exit 1; }
VERSION=$("$BIN" --version | awk '{print $2}')
ARCH=$(dpkg --print-architecture)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvcompd-deb.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/kvcompd

install -d "$ROOT/DEBIAN" "$ROOT/usr/bin" "$ROOT/etc/kvcomp" "$ROOT/lib/systemd/system" \
  "$ROOT/usr/share/doc/kvcompd"
objcopy --strip-debug "$BIN" "$ROOT/usr/bin/kvcompd"
"$BIN" --print-config --storage.data_dir=/var/lib/kvcomp >"$ROOT/etc/kvcomp/kvcompd.yaml"
install -m 0644 packaging/deb/kvcompd.service "$ROOT/lib/systemd/system/kvcompd.service"
install -m 0644 README.md docs/configuration.md docs/operations.md docs/metrics.md \
  "$ROOT/usr/share/doc/kvcompd/"

# Debian packages of the linked libraries; the rest are named in the description.
mkdir -p "$WORK/shlibs/debian"
printf 'Source: kvcompd\n\nPackage: kvcompd\nArchitecture: any\n' >"$WORK/shlibs/debian/control"
DEPENDS=$(cd "$WORK/shlibs" && dpkg-shlibdeps -O --ignore-missing-info -e "$ROOT/usr/bin/kvcompd" \
  2>/dev/null | sed -n 's/^shlibs:Depends=//p')
OUTSIDE=$(ldd "$ROOT/usr/bin/kvcompd" | awk '/=> \// {print $3}' | while read -r lib; do
  dpkg -S "$(readlink -f "$lib")" >/dev/null 2>&1 || dpkg -S "$lib" >/dev/null 2>&1 \
    || basename "$lib"; done | sort -u | tr '\n' ' ')
SIZE=$(du -ks "$ROOT" | cut -f1)
{
  echo "Package: kvcompd"
  echo "Version: $VERSION"
  echo "Architecture: $ARCH"
  echo "Maintainer: kvcomp <kvcomp@localhost>"
  echo "Installed-Size: $SIZE"
  echo "Depends: $DEPENDS"
  echo "Section: net"
  echo "Priority: optional"
  echo "Description: KV-cache compression sidecar for disaggregated LLM serving"
  echo " kvcompd receives KV caches from prefill nodes over UCX, compresses them (token"
  echo " eviction, MomentKV moments, KVSplice and int8 codecs), stores them in GPU, host and"
  echo " RocksDB tiers and serves them to decode nodes. systemctl enable --now kvcompd starts it"
  echo " on /etc/kvcomp/kvcompd.yaml (127.0.0.1:7470 data, 7471 control, 7472 metrics)."
  if [ -n "${OUTSIDE// /}" ]; then
    echo " ."
    echo " Libraries it links that no Debian package provides here: ${OUTSIDE% }."
  fi
} >"$ROOT/DEBIAN/control"
echo "/etc/kvcomp/kvcompd.yaml" >"$ROOT/DEBIAN/conffiles"
DEB=$OUT/kvcompd_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group --build "$ROOT" "$DEB" >/dev/null
echo "$DEB"
