// Package volume holds a worker's team volumes: persistent named
// directories that sandboxes mount (E2B's /volumes and volumeMounts).
//
// Each volume is a file system of its own, so its quota is a size and not
// an accounting: a sparse ext4 image, Root/<id>.img, of Config.SizeBytes
// (default 10 GiB, costing the host only what is written). While a
// sandbox uses it the image is attached to a loop device and mounted
// detached (fsmount: in no mount namespace, so no namespace cloned
// meanwhile keeps a copy alive), and each sandbox gets a clone of the
// mount's data/ directory (idmapped for its user namespace by the
// substrate). A host mounts an image through one loop device only: the
// device is found again by the image's inode (LOOP_GET_STATUS64) under
// an flock on Root/<id>.lock, and mounting one block device again yields
// the same superblock, so every sandbox of every worker process on the
// host sees one file system (POSIX semantics between them) and the image
// is never written by two file systems at once. The loop device detaches
// itself (autoclear) when the last mount of it, in the last sandbox, is
// gone; nothing here has to outlive a worker restart.
//
// Ownership: data/ is made 1000:1000 0755 on disk (the sandbox's `user`
// as the ns substrate's idmapping stores ids: disk id N reads as N inside
// whatever host range the sandbox has), so `user` writes there by
// default and root inside can chown. Writes past the quota fail with
// ENOSPC inside the sandbox. The image is formatted here and only ever
// written by the kernel through the loop device: never mount one that
// came from elsewhere (the ext4 parser is not hardened against hostile
// images).
//
// Root defaults to <data dir>/volumes on the worker's disk. For volumes
// that follow sandboxes across hosts the operator mounts shared storage
// (NFS) and points Root there (space-node/space up --volume-root). An
// image is used by one host at a time: nothing in the control plane
// keeps two sandboxes of one volume off workers of different hosts (nor a
// move between hosts while the old execution still holds the volume),
// but the images are made with ext4 multi-mount protection (MMP): the
// second host's mount is refused, so its sandbox fails to start (a move
// fails and the sandbox stays where it was) instead of two file systems
// writing one image.
package volume

import (
	"crypto/rand"
	"encoding/hex"
)

// DefaultSize is a new volume's quota when Config.SizeBytes is zero.
const DefaultSize = 10 << 30

// MinSize is the smallest quota (ext4's journal and tables need room).
const MinSize = 16 << 20

// DataDir is the directory on a volume's file system that sandboxes see
// (the file system's root keeps lost+found out of their view).
const DataDir = "data"

// UserID and GroupID own DataDir on a new volume: the sandbox's `user`.
const (
	UserID  = 1000
	GroupID = 1000
)

// NewID returns a fresh volume id (vol_<24 hex>).
func NewID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return "vol_" + hex.EncodeToString(b)
}
