//go:build linux

package microvm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// The writable layer disk of an image VM: a sparse ext4 image of
// Limits.DiskBytes at Spec.Dir/LayerDiskName, attached read-write
// (virtio-blk) and mounted by the guest as its root overlay's upper layer
// (upper/ and work/ in its root). It is the sandbox's disk quota, its files
// no longer count against guest memory, and it survives Stop: a Start on
// the same directory boots with the same layer. The host formats it once
// (mkfs.ext4) and afterwards only copies its bytes (a template's disk into
// a clone's directory, a saved state's disk into a restore's): the host
// never mounts a file system a guest wrote.

// LayerDiskName is the writable layer disk's file in the activation
// directory (image VMs only).
const LayerDiskName = "layer.img"

// layerDiskSize is Limits.DiskBytes rounded up to whole MiB.
func layerDiskSize(n int64) int64 {
	return (n + (1<<20 - 1)) &^ (1<<20 - 1)
}

// createLayerDisk formats a new layer disk of size bytes at path, which
// must not exist. Like the ns substrate's layer disks: 256-byte inodes, no
// reserved blocks, a small journal, lazy initialization (the new file is
// all holes, so the tables read as zeros and nothing is allocated).
func (s *Substrate) createLayerDisk(path string, size int64) error {
	mkfs, err := findMkfs(s.cfg.MkfsPath)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("microvm: layer disk: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		journal := min(max(size>>20/64, 4), 16)
		cmd := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-b", "4096", "-m", "0", "-i", "16384", "-I", "256",
			"-L", "space-layer", "-O", "^resize_inode", "-J", fmt.Sprintf("size=%d", journal),
			"-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", tmp)
		cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if rerr := cmd.Run(); rerr != nil {
			err = fmt.Errorf("%s: %v: %s", mkfs, rerr, strings.TrimSpace(out.String()))
		}
	}
	if err == nil {
		err = os.Link(tmp, path) // never replaces an existing layer
	}
	_ = os.Remove(tmp)
	if err != nil {
		return fmt.Errorf("microvm: layer disk: %w", err)
	}
	return nil
}

// copyLayerDisk copies the layer disk src (a template's) to the new file
// path, keeping holes.
func copyLayerDisk(path string, src *os.File) error {
	fi, err := src.Stat()
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	dst, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("microvm: layer disk: %w", err)
	}
	err = sparseCopy(dst, src, fi.Size())
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Link(tmp, path)
	}
	_ = os.Remove(tmp)
	if err != nil {
		return fmt.Errorf("microvm: layer disk: %w", err)
	}
	return nil
}

// dataExtents calls fn for each data extent [off, off+n) of f's first size
// bytes (SEEK_DATA/SEEK_HOLE).
func dataExtents(f *os.File, size int64, fn func(off, n int64) error) error {
	fd := int(f.Fd())
	var off int64
	for off < size {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole left
		}
		if err != nil {
			return fmt.Errorf("seek data: %w", err)
		}
		if data >= size {
			return nil
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole: %w", err)
		}
		hole = min(hole, size)
		if err := fn(data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return nil
}

// sparseCopy copies size bytes of src to the empty dst keeping holes: one
// FICLONE where the file system shares extents, else copy_file_range of
// each data extent.
func sparseCopy(dst, src *os.File, size int64) error {
	if err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd())); err == nil {
		return nil
	}
	if err := dst.Truncate(size); err != nil {
		return err
	}
	return dataExtents(src, size, func(off, n int64) error {
		in, out := off, off
		for in < off+n {
			c, err := unix.CopyFileRange(int(src.Fd()), &in, int(dst.Fd()), &out, int(off+n-in), 0)
			if err != nil {
				// Another file system, or none that supports it: plain copies.
				_, err = io.Copy(io.NewOffsetWriter(dst, in), io.NewSectionReader(src, in, off+n-in))
				return err
			}
			if c == 0 {
				return io.ErrUnexpectedEOF
			}
		}
		return nil
	})
}

// A layer disk in a saved state (state.go): after the header, records of
// a big-endian uint64 offset and uint64 length followed by that many
// bytes of data, in increasing, non-overlapping order, ended by a record
// of length 0. Holes are not stored.
const (
	maxLayerExtents = 1 << 22
)

// writeLayer writes f's data extents (its first size bytes) to w as
// layer records and returns the bytes written.
func writeLayer(w io.Writer, f *os.File, size int64) (int64, error) {
	var total int64
	var rec [16]byte
	err := dataExtents(f, size, func(off, n int64) error {
		binary.BigEndian.PutUint64(rec[:8], uint64(off))
		binary.BigEndian.PutUint64(rec[8:], uint64(n))
		if _, err := w.Write(rec[:]); err != nil {
			return err
		}
		total += 16
		c, err := io.Copy(w, io.NewSectionReader(f, off, n))
		total += c
		if err == nil && c != n {
			err = io.ErrUnexpectedEOF
		}
		return err
	})
	if err != nil {
		return total, fmt.Errorf("layer disk: %w", err)
	}
	binary.BigEndian.PutUint64(rec[:8], 0)
	binary.BigEndian.PutUint64(rec[8:], 0)
	_, err = w.Write(rec[:])
	return total + 16, err
}

// readLayer reads layer records from r into dst (truncated to size
// first). Records out of order, overlapping or past size are refused: a
// state file is input.
func readLayer(r io.Reader, dst *os.File, size int64) error {
	if err := dst.Truncate(0); err != nil {
		return err
	}
	if err := dst.Truncate(size); err != nil {
		return err
	}
	var rec [16]byte
	var next int64
	for i := 0; ; i++ {
		if i > maxLayerExtents {
			return fmt.Errorf("microvm: %w: state's layer disk has more than %d extents", errdefs.ErrInvalid, maxLayerExtents)
		}
		if _, err := io.ReadFull(r, rec[:]); err != nil {
			return fmt.Errorf("microvm: state's layer disk: %w", err)
		}
		off, n := binary.BigEndian.Uint64(rec[:8]), binary.BigEndian.Uint64(rec[8:])
		if n == 0 {
			return nil
		}
		if off > uint64(size) || n > uint64(size)-off || int64(off) < next {
			return fmt.Errorf("microvm: %w: state's layer disk extent %d+%d out of order or past %d bytes", errdefs.ErrInvalid, off, n, size)
		}
		if _, err := io.CopyN(io.NewOffsetWriter(dst, int64(off)), r, int64(n)); err != nil {
			return fmt.Errorf("microvm: state's layer disk: %w", err)
		}
		next = int64(off + n)
	}
}
