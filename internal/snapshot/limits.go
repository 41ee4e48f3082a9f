//go:build linux

package snapshot

import (
	"fmt"
	"io"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// Limits bound one archive or restore. They are enforced while the archive
// streams, before anything beyond them is written, so a sandbox cannot turn
// its writable layer into an unbounded file on the host (on either side of
// a move). Zero fields take the defaults.
type Limits struct {
	// MaxEntries bounds the number of entries. Default 4 Mi.
	MaxEntries int
	// MaxBytes bounds the regular-file content stored in the archive (the
	// data of the files: what reaches the disk on both sides; holes of
	// sparse files are not stored). Default 64 GiB.
	MaxBytes int64
	// MaxLogical bounds the sum of the regular files' sizes, holes
	// included. Default 1 TiB.
	MaxLogical int64
}

func (l *Limits) defaults() {
	if l.MaxEntries <= 0 {
		l.MaxEntries = 4 << 20
	}
	if l.MaxBytes <= 0 {
		l.MaxBytes = 64 << 30
	}
	if l.MaxLogical <= 0 {
		l.MaxLogical = 1 << 40
	}
}

// FreeSpace keeps a reserve free on the file system an archive or a
// restore writes to: the write is refused up front, and stopped while it
// streams, when it would leave less than the reserve. Zero fields take the
// defaults.
type FreeSpace struct {
	// MinFree is the smallest reserve in bytes. Default 1 GiB.
	MinFree int64
	// MinFreePercent is the reserve as a share of the file system's size
	// when that is more than MinFree. Default 5.
	MinFreePercent float64
	// CheckEvery is how many bytes may be written between two checks
	// (the reserve absorbs them; so do other writers between checks).
	// Default 64 MiB.
	CheckEvery int64
	// Statfs replaces unix.Statfs (tests).
	Statfs func(path string, st *unix.Statfs_t) error
	// Off: the target is a file system of its own that nothing else
	// needs (a sandbox's layer disk, bounded by its size): no reserve.
	Off bool
}

func (f *FreeSpace) defaults() {
	if f.MinFree <= 0 {
		f.MinFree = 1 << 30
	}
	if f.MinFreePercent <= 0 {
		f.MinFreePercent = 5
	}
	if f.CheckEvery <= 0 {
		f.CheckEvery = 64 << 20
	}
	if f.Statfs == nil {
		f.Statfs = unix.Statfs
	}
}

var (
	// ErrOverLimit is matched (errors.Is) by an archive or restore that
	// would exceed its Limits. It is an errdefs.ErrInvalid: retrying the
	// same snapshot cannot succeed.
	ErrOverLimit = errdefs.Message(errdefs.ErrInvalid, "snapshot too large")
	// ErrNoSpace is matched by an archive or restore refused because its
	// destination file system would drop below its free-space reserve. It
	// is an errdefs.ErrUnavailable: another worker or a later try may
	// have room.
	ErrNoSpace = errdefs.Message(errdefs.ErrUnavailable, "not enough free space")
)

// spaceGuard checks one file system's free space for a stream of writes.
// A nil guard checks nothing.
type spaceGuard struct {
	path    string
	cfg     FreeSpace
	pending int64 // bytes written since the last check
}

func newSpaceGuard(path string, cfg FreeSpace) *spaceGuard {
	if path == "" || cfg.Off {
		return nil
	}
	cfg.defaults()
	return &spaceGuard{path: path, cfg: cfg}
}

// check refuses when writing n more bytes would leave less than the
// reserve free.
func (g *spaceGuard) check(n int64) error {
	if g == nil {
		return nil
	}
	g.pending = 0
	var st unix.Statfs_t
	if err := g.cfg.Statfs(g.path, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", g.path, err)
	}
	avail := int64(st.Bavail) * int64(st.Bsize)
	reserve := max(g.cfg.MinFree, int64(float64(int64(st.Blocks)*int64(st.Bsize))*g.cfg.MinFreePercent/100))
	if avail < 0 || n > avail-reserve {
		return fmt.Errorf("%w on %s: need %s (%s to write + %s reserve), have %s", ErrNoSpace, g.path, human(n+reserve), human(n), human(reserve), human(avail))
	}
	return nil
}

// wrote accounts for n bytes about to be written and checks once
// CheckEvery bytes have gone out since the last check.
func (g *spaceGuard) wrote(n int64) error {
	if g == nil {
		return nil
	}
	g.pending += n
	if g.pending < g.cfg.CheckEvery {
		return nil
	}
	return g.check(n)
}

// large checks before a write of n bytes that alone is more than the
// periodic checks let through.
func (g *spaceGuard) large(n int64) error {
	if g == nil || n < g.cfg.CheckEvery {
		return nil
	}
	return g.check(n)
}

// guardWriter runs every write past a spaceGuard first.
type guardWriter struct {
	w io.Writer
	g *spaceGuard
}

func (w guardWriter) Write(p []byte) (int, error) {
	if err := w.g.wrote(int64(len(p))); err != nil {
		return 0, err
	}
	return w.w.Write(p)
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes", n)
}
