//go:build linux

package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/substrate"
)

// Recovery of an image VM whose QEMU died (substrate.LayerSaver): its
// memory and processes are gone, its files are not (they are on its layer
// disk). The disk is saved as it is, in a layer state (a state file of
// layerStateVersion: the header, the disk's layer records, nothing else),
// and Start boots a new VM cold on it. The host still never mounts it.
//
// The disk is read only once nothing can write it any more, which two
// things say, each on its own: the activation's adoption record is gone
// (Stop and Reclaim remove it only once its QEMU was seen to exit, or was
// found not to be the recorded process), and the disk's write lock can be
// had. Start takes that lock (an OFD lock on the disk's read-write open
// file description, which QEMU inherits and which lives as long as any
// copy of it does: QEMU's, its children's), so the kernel itself says
// whether a QEMU still holds the disk, whatever the records say.

var _ substrate.LayerSaver = (*Substrate)(nil)

// HasLayer reports whether the activation of dir is an image VM's: its
// files are on its layer disk.
func (s *Substrate) HasLayer(dir string) bool {
	fi, err := os.Lstat(filepath.Join(dir, LayerDiskName))
	return err == nil && fi.Mode().IsRegular()
}

// SaveLayer writes the layer disk of the ended activation of dir to w as
// a layer state (see above) and returns the bytes written. It refuses an
// activation whose QEMU was not seen to end or whose disk is still held,
// and one without a layer disk (a busybox VM: its files lived in its
// memory).
func (s *Substrate) SaveLayer(ctx context.Context, dir string, w io.Writer) (int64, error) {
	if _, err := os.Lstat(filepath.Join(dir, RecordName)); err == nil {
		return 0, fmt.Errorf("microvm: save layer: %w: the activation's QEMU was not seen to end (its adoption record is still there); its disk may still be written", errdefs.ErrConflict)
	} else if !errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("microvm: save layer: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, LayerDiskName), os.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("microvm: save layer: %w: the VM has no layer disk (its files lived in its memory)", errdefs.ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("microvm: save layer: %w", err)
	}
	defer f.Close()
	// Held until the disk is read: a Start on this directory meanwhile
	// fails rather than write under the copy.
	if err := lockLayer(f); err != nil {
		return 0, fmt.Errorf("microvm: save layer: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("microvm: save layer: %w", err)
	}
	if !fi.Mode().IsRegular() || !validLayerSize(fi.Size()) {
		return 0, fmt.Errorf("microvm: save layer: %w: %s is not a layer disk (%s, %d bytes)", errdefs.ErrInvalid, f.Name(), fi.Mode().Type(), fi.Size())
	}
	h := stateHeader{Version: layerStateVersion, SavedAt: time.Now().UTC(), Layer: &layerRef{Size: fi.Size()}}
	hdr, err := h.marshal()
	if err != nil {
		return 0, err
	}
	n, err := w.Write(hdr)
	total := int64(n)
	if err != nil {
		return total, fmt.Errorf("microvm: save layer: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return total, fmt.Errorf("microvm: save layer: %w", err)
	}
	c, err := writeLayer(w, f, fi.Size())
	total += c
	if err != nil {
		return total, fmt.Errorf("microvm: save layer: %w", err)
	}
	return total, nil
}

// lockLayer takes the write lock of the whole layer disk on f's open
// file description (f open read-write), or says that another description
// holds a lock on it: a QEMU (or a save) still has the disk.
func lockLayer(f *os.File) error {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart}
	err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &lk)
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
		return fmt.Errorf("%w: layer disk %s is held by a running VM", errdefs.ErrConflict, f.Name())
	}
	if err != nil {
		return fmt.Errorf("lock layer disk %s: %w", f.Name(), err)
	}
	return nil
}

// validLayerSize: a layer disk is whole MiB within the disk limits.
func validLayerSize(n int64) bool {
	return n >= MinDiskBytes && n <= MaxDiskBytes && n%(1<<20) == 0
}

// checkLayerState rejects a layer state this spec cannot boot on: one
// without a disk, or a spec without an image (a busybox VM has no layer
// disk to boot with).
func checkLayerState(h stateHeader, root *rootSpec) error {
	switch {
	case h.Layer == nil || !validLayerSize(h.Layer.Size):
		return fmt.Errorf("microvm: restore: %w: layer state without a valid layer disk", errdefs.ErrInvalid)
	case root == nil:
		return fmt.Errorf("microvm: restore: %w: the state is an image VM's layer disk, the spec names no image", errdefs.ErrInvalid)
	}
	return nil
}

// restoreLayerState writes the layer disk of a layer state (positioned
// after its header) to the new path and checks that nothing follows it.
func restoreLayerState(f *os.File, path string, size int64) error {
	if err := restoreLayer(f, path, size); err != nil {
		return err
	}
	var b [1]byte
	if n, err := f.Read(b[:]); n != 0 || !errors.Is(err, io.EOF) {
		_ = os.Remove(path)
		return fmt.Errorf("microvm: restore: %w: data after the layer state's disk", errdefs.ErrInvalid)
	}
	return nil
}
