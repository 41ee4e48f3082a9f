// Package snapshot stores and restores snapshots of a sandbox's writable
// layer (DESIGN.md section 10: snapshot = filesystem archive; resume on
// another worker restores the files and restarts the processes).
//
// A snapshot is one opaque object in a Store, named by an id the control
// plane chooses. Its content is a tar archive of the overlay upper
// directory (see Archive and Restore for the format). The Store interface
// is deliberately the shape of an object store (put a stream, get a
// stream, delete), so an S3/GCS implementation can replace the local
// directory one without touching its callers.
package snapshot

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
)

// Store holds snapshot objects.
//
// Implementations must be safe for concurrent use and must honour these
// rules, which are what callers rely on:
//   - Put is atomic: Open never sees a partially written object; a Put that
//     fails (or whose ctx ends) leaves the previous object under id (if
//     any) in place. A successful Put of an existing id replaces it (a
//     retried snapshot overwrites, as object stores do). Put returns once
//     the object is durable and reports its size in bytes.
//   - Open returns ErrNotFound (errdefs.ErrNotFound) for an unknown id.
//     Reading a stream whose ctx ended may fail.
//   - Delete of an unknown id returns ErrNotFound; callers that only want
//     the object gone ignore it.
//   - Every method rejects an id that ValidateID refuses with
//     errdefs.ErrInvalid before touching storage.
type Store interface {
	Put(ctx context.Context, id string, r io.Reader) (int64, error)
	Open(ctx context.Context, id string) (io.ReadCloser, error)
	Delete(ctx context.Context, id string) error
}

// MaxIDLen bounds snapshot ids.
const MaxIDLen = 128

// ValidateID accepts 1..128 characters of [A-Za-z0-9._-] starting with a
// letter or digit. Such an id is a single path element on every file system
// and a safe object key: no separators, no "." or "..", no NUL, no leading
// dot (hidden/temporary files of the local store start with one).
func ValidateID(id string) error {
	if len(id) == 0 || len(id) > MaxIDLen {
		return fmt.Errorf("snapshot: %w: id must be 1..%d characters", errdefs.ErrInvalid, MaxIDLen)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case (c == '.' || c == '_' || c == '-') && i > 0:
		default:
			return fmt.Errorf("snapshot: %w: id %q: only letters, digits, '.', '_' and '-' (not first) are allowed", errdefs.ErrInvalid, id)
		}
	}
	return nil
}

// Local is a Store in a local directory: one file per snapshot, written to
// a temporary file, fsynced, renamed into place and the directory fsynced.
// Several workers (and processes) may share one directory.
type Local struct {
	dir string
}

var _ Store = (*Local)(nil)

const tmpPrefix = ".tmp-"

// lockedSuffix ends the names of temporaries whose writer holds an flock
// on them while it writes.
const lockedSuffix = ".locked"

// abandoned reports whether p is a locked-writer temporary that no
// process holds: its writer died.
func abandoned(p string) bool {
	if !strings.HasSuffix(p, lockedSuffix) {
		return false
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	return unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil
}

// NewLocal opens (creating it 0700 if needed) a local snapshot directory
// and removes the temporary files crashed writers left: a writer holds an
// flock on its temporary file until it is renamed or removed, so one that
// nobody holds is a dead writer's (another process sharing the directory
// may be writing the others). Older temporaries without a lock holder go
// too; a temporary from before writers locked goes after an hour.
func NewLocal(dir string) (*Local, error) {
	if dir == "" {
		return nil, fmt.Errorf("snapshot: %w: empty directory", errdefs.ErrInvalid)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	if err := os.MkdirAll(abs, 0o700); err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	ents, err := os.ReadDir(abs)
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), tmpPrefix) {
			continue
		}
		p := filepath.Join(abs, e.Name())
		if abandoned(p) {
			_ = os.Remove(p)
		} else if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > time.Hour && !strings.HasSuffix(e.Name(), lockedSuffix) {
			_ = os.Remove(p)
		}
	}
	return &Local{dir: abs}, nil
}

// Dir is the store's directory.
func (l *Local) Dir() string { return l.dir }

func (l *Local) path(id string) (string, error) {
	if err := ValidateID(id); err != nil {
		return "", err
	}
	return filepath.Join(l.dir, id), nil
}

// ContextReader returns r failing its reads once ctx has ended, so that a
// copy from a source that ignores ctx still stops with it.
func ContextReader(ctx context.Context, r io.Reader) io.Reader { return ctxReader{ctx, r} }

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// Put writes r under id atomically and durably.
func (l *Local) Put(ctx context.Context, id string, r io.Reader) (int64, error) {
	dst, err := l.path(id)
	if err != nil {
		return 0, err
	}
	var rnd [8]byte
	rand.Read(rnd[:])
	tmp := filepath.Join(l.dir, tmpPrefix+id+"-"+hex.EncodeToString(rnd[:])+lockedSuffix)
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, fmt.Errorf("snapshot: put %s: %w", id, err)
	}
	// Held until the file is closed: the lock tells a restarted process
	// (NewLocal) that this temporary has a live writer. A crash releases it.
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		os.Remove(tmp)
		return 0, fmt.Errorf("snapshot: put %s: lock temporary: %w", id, err)
	}
	fail := func(err error) (int64, error) {
		f.Close()
		os.Remove(tmp)
		return 0, fmt.Errorf("snapshot: put %s: %w", id, err)
	}
	n, err := io.Copy(f, ctxReader{ctx, r})
	if err != nil {
		return fail(err)
	}
	crashpoint.Hit(crashpoint.PutWritten)
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	// Renamed while still locked: an unlocked temporary may be removed by
	// a process opening the directory at that moment.
	if err := os.Rename(tmp, dst); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return 0, fmt.Errorf("snapshot: put %s: %w", id, err)
	}
	if err := syncDir(l.dir); err != nil {
		return 0, fmt.Errorf("snapshot: put %s: sync directory: %w", id, err)
	}
	return n, nil
}

// Open returns the snapshot's content.
func (l *Local) Open(_ context.Context, id string) (io.ReadCloser, error) {
	p, err := l.path(id)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("snapshot: open %s: %w", id, err)
	}
	return f, nil
}

// Delete removes the snapshot.
func (l *Local) Delete(_ context.Context, id string) error {
	p, err := l.path(id)
	if err != nil {
		return err
	}
	if err := os.Remove(p); errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("snapshot %s: %w", id, errdefs.ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("snapshot: delete %s: %w", id, err)
	}
	return syncDir(l.dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
