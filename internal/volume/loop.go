//go:build linux

package volume

// Loop devices of volumes: attaching and mounting are internal/loopdev's
// (the ns substrate's layer disks use it too); a volume's loop device is
// shared by every sandbox of the host, so it is looked up before one is
// attached.

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/loopdev"
)

const (
	blockSize = 4096
	// mountData: remount read-only on an I/O error (the host full under a
	// sparse image) rather than go on; discard gives deleted blocks back
	// to the host; noinit_itable keeps the kernel from zeroing the inode
	// tables of the sparse image (they read as zeros already).
	mountData = "errors=remount-ro,discard,noinit_itable"
)

// findLoop returns the loop device attached to the file ist describes
// (open: it stays attached while open) and its number, or nil.
func findLoop(ist unix.Stat_t) (*os.File, uint64, error) {
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return nil, 0, err
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		if _, err := os.Stat("/sys/block/" + e.Name() + "/loop/backing_file"); err != nil {
			continue // not attached
		}
		f, err := loopdev.Open(e.Name(), os.O_RDONLY)
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENXIO) {
			continue // removed meanwhile
		}
		if err != nil {
			// Not knowing a device that may back the image would mount it
			// twice: fail instead.
			return nil, 0, fmt.Errorf("inspect %s: %w", e.Name(), err)
		}
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		var st unix.Stat_t
		if err == nil && info.Device == ist.Dev && info.Inode == ist.Ino &&
			unix.Fstat(int(f.Fd()), &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && unix.Major(st.Rdev) == loopdev.Major {
			return f, st.Rdev, nil
		}
		f.Close()
	}
	return nil, 0, nil
}
