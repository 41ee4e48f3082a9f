#!/usr/bin/env bash
# hide-kvm.sh CMD [ARGS...]: run CMD in a private mount namespace whose /dev
# has no kvm node, as on a host without /dev/kvm (the rest of /dev is the
# host's: the same nodes, and pts, shm and mqueue bound in). Nothing
# outside the namespace changes. For checking the no-KVM path on a host
# that has /dev/kvm (e.g. `scripts/hide-kvm.sh make test`).
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "hide-kvm: needs root" >&2; exit 2; }
if [ "${SPACE_HIDE_KVM_INNER:-}" != 1 ]; then
	exec unshare --mount --propagation private env SPACE_HIDE_KVM_INNER=1 "$0" "$@"
fi
new=$(mktemp -d /run/space-nokvm-dev.XXXXXX)
mount -t tmpfs -o mode=755,nosuid tmpfs "$new"
# Device nodes, links and plain files, not what is mounted below /dev.
cp -ax /dev/. "$new/"
rm -f "$new/kvm"
for m in pts shm mqueue hugepages; do
	if mountpoint -q "/dev/$m"; then mkdir -p "$new/$m" && mount --rbind "/dev/$m" "$new/$m"; fi
done
mount --move "$new" /dev
rmdir "$new" 2>/dev/null || true
[ ! -e /dev/kvm ] || { echo "hide-kvm: /dev/kvm still visible" >&2; exit 1; }
exec "$@"
