#!/usr/bin/env bash
# vm-kernel.sh DEST META: resolve META (a Debian kernel metapackage such as
# linux-image-cloud-amd64) to the kernel package the archive serves today,
# extract it once per package version into a machine-wide cache
# ($SPACE_CACHE_DIR, default /var/cache/space) and point DEST at it.
#
# The package lists are refreshed first: stale lists name a kernel the
# archive may no longer serve, or an older one than a fresh machine gets,
# and a test that passes on an old kernel proves nothing about today's.
# The kernel is extracted (never installed into /boot); vmlinuz and modules
# are links inside the cached tree.
set -euo pipefail
dest=$1 meta=$2
cache=${SPACE_CACHE_DIR:-/var/cache/space}/vm-kernel

resolve() { apt-cache depends "$meta" 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}'; }
if [ "${SPACE_VM_KERNEL_NO_UPDATE:-}" = "" ]; then
	apt-get update -qq || echo "vm-kernel: apt-get update failed; using the package lists as they are" >&2
fi
pkg=$(resolve)
[ -n "$pkg" ] || { echo "vm-kernel: cannot resolve $meta to a kernel package" >&2; exit 1; }
ver=$(apt-cache policy "$pkg" | awk '/Candidate:/ {print $2; exit}')
[ -n "$ver" ] && [ "$ver" != "(none)" ] || { echo "vm-kernel: no candidate version for $pkg" >&2; exit 1; }
dir=$cache/${pkg}_${ver//:/%}
if [ ! -e "$dir/.done" ]; then
	mkdir -p "$cache"
	tmp=$(mktemp -d "$cache/.tmp.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	chmod 755 "$tmp"; chown _apt "$tmp" 2>/dev/null || true
	(cd "$tmp" && apt-get download -qq "$pkg=$ver")
	mkdir "$tmp/tree"
	dpkg-deb -x "$tmp"/*.deb "$tmp/tree"
	(cd "$tmp/tree" && ln -sfn "$(ls boot/vmlinuz-* | head -n1)" vmlinuz && ln -sfn "$(ls -d lib/modules/* | head -n1)" modules)
	echo "$pkg $ver" > "$tmp/tree/.done"
	rm -rf "$dir"
	mv "$tmp/tree" "$dir"
	echo "vm-kernel: extracted $pkg $ver into $dir"
fi
mkdir -p "$(dirname "$dest")"
[ -L "$dest" ] || rm -rf "$dest" # an older layout kept a real directory here
ln -sfn "$dir" "$dest.new" && mv -T "$dest.new" "$dest"
echo "vm-kernel: $(cat "$dest/.done") at $dest"
