//go:build linux

package ns

// Spare layer disks. Making a layer disk (a sparse copy of the golden
// image, a loop device, an ext4 mount: about 4 ms, mostly waiting on the
// host's disk) is most of what the disk quota adds to a sandbox start. So,
// like the warm init (warm.go), one disk of the size last asked for is
// made ahead of time: its image under StateDir/spare, its file system
// mounted detached. The next activation directory that needs a new disk
// of that size takes it: the image is linked into the directory (the loop
// device follows the inode, not the name) and the mount is used as it is.

import (
	"errors"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// spareDisk is a mounted, unused layer disk.
type spareDisk struct {
	disk *layerDisk
	size int64
}

// spareDir holds this substrate's spare images: one directory per cgroup
// parent, so the substrates of several workers sharing a StateDir (space
// up) never clear each other's.
func (s *Substrate) spareDir() string {
	return filepath.Join(s.cfg.StateDir, "spare", filepath.FromSlash(s.cfg.CgroupParent))
}

// clearSpares removes the images a previous process left (their mounts
// died with it): the files of spareDir, not the directories of nested
// cgroup parents' substrates.
func (s *Substrate) clearSpares() {
	ents, _ := os.ReadDir(s.spareDir())
	for _, e := range ents {
		if e.Type().IsRegular() {
			_ = os.Remove(filepath.Join(s.spareDir(), e.Name()))
		}
	}
}

// prewarmDisk makes a spare disk of size in the background unless one
// exists or is being made.
func (s *Substrate) prewarmDisk(size int64) {
	s.spareMu.Lock()
	if s.spare != nil || s.sparing {
		s.spareMu.Unlock()
		return
	}
	s.sparing = true
	s.spareMu.Unlock()
	// Owned like the warm init's goroutine: Close (stopWarm) waits for it.
	s.warmMu.Lock()
	closed := s.closed
	if !closed {
		s.warmWG.Add(1)
	}
	s.warmMu.Unlock()
	if closed {
		s.spareMu.Lock()
		s.sparing = false
		s.spareMu.Unlock()
		return
	}
	go func() {
		defer s.warmWG.Done()
		sp, err := s.makeSpare(size)
		if err != nil {
			s.cfg.Logger.Debug("ns: no spare layer disk", "err", err)
		}
		s.warmMu.Lock()
		closed := s.closed
		s.warmMu.Unlock()
		s.spareMu.Lock()
		s.sparing = false
		keep := err == nil && !closed && s.spare == nil
		if keep {
			s.spare = sp
		}
		s.spareMu.Unlock()
		if err == nil && !keep {
			sp.discard()
		}
	}()
}

func (s *Substrate) makeSpare(size int64) (*spareDisk, error) {
	if err := os.MkdirAll(s.spareDir(), 0o700); err != nil {
		return nil, err
	}
	img := filepath.Join(s.spareDir(), randHex(8)+".img")
	if err := createDisk(s.cfg.StateDir, img, size); err != nil {
		return nil, err
	}
	d, err := openDisk(img)
	if err != nil {
		_ = os.Remove(img)
		return nil, err
	}
	return &spareDisk{disk: d, size: size}, nil
}

func (sp *spareDisk) discard() {
	_ = sp.disk.Unmount()
	_ = os.Remove(sp.disk.img)
}

// takeSpare gives activation directory dir the spare disk if it has size
// bytes: its image becomes dir/DiskImageName. nil when there is none or
// the link failed (another file system: the spare is dropped).
func (s *Substrate) takeSpare(dir string, size int64) *layerDisk {
	s.spareMu.Lock()
	sp := s.spare
	if sp != nil && sp.size == size {
		s.spare = nil
	} else {
		sp = nil
	}
	s.spareMu.Unlock()
	if sp == nil {
		return nil
	}
	img := filepath.Join(dir, DiskImageName)
	// A rename that never replaces dir's image: the loop device shows the
	// path it was attached through as long as that name is the file's
	// (after a link and an unlink it would show the spare's name,
	// "(deleted)", and loopBacks, which Reclaim and the next mount's wait
	// rely on, would no longer see the disk). A link where the file
	// system cannot rename without replacing.
	err := unix.Renameat2(unix.AT_FDCWD, sp.disk.img, unix.AT_FDCWD, img, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) {
		if err = os.Link(sp.disk.img, img); err == nil {
			_ = os.Remove(sp.disk.img)
		}
	}
	if err != nil {
		if !errors.Is(err, os.ErrExist) {
			s.cfg.Logger.Debug("ns: spare layer disk not taken", "err", err)
		}
		sp.discard()
		return nil
	}
	sp.disk.img = img
	return sp.disk
}

// stopSpares discards the spare disk (Close, after stopWarm).
func (s *Substrate) stopSpares() {
	s.spareMu.Lock()
	sp := s.spare
	s.spare = nil
	s.spareMu.Unlock()
	if sp != nil {
		sp.discard()
	}
}
