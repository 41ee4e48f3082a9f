//go:build linux

// Package layerstore keeps image layers on the host as directory trees in
// overlayfs lower-layer form (the contract in docs: whiteouts are 0:0
// character devices, opaque directories carry trusted.overlay.opaque=y and
// user.overlay.opaque=y), each published once and never changed after.
//
// Layers hold the image's own owners and modes, setuid files included:
// they are root only inside a sandbox's user namespace, and the store's
// root is 0700 so no host user other than root ever reaches them.
//
// Layout under Config.Root:
//
//	layers/<algo>-<hex>/   a published layer (read-only by convention)
//	tmp/<algo>-<hex>.*/    a layer being filled; renamed into layers/ when done
//	locks/<algo>-<hex>     flock: one filler per id across goroutines and processes
package layerstore

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacesbx/space/internal/errdefs"
)

// Config configures a Store.
type Config struct {
	// Root is the store's directory, created 0700 if missing (and made
	// 0700 if it exists). Required; must be absolute and free of ':', ','
	// and '\\' (layer dirs go into overlay's lowerdir option).
	Root string
}

// Validate reports whether c is usable.
func (c Config) Validate() error {
	if c.Root == "" {
		return fmt.Errorf("layerstore: %w: Root is required", errdefs.ErrInvalid)
	}
	if !filepath.IsAbs(c.Root) {
		return fmt.Errorf("layerstore: %w: Root %q is not absolute", errdefs.ErrInvalid, c.Root)
	}
	// Layer dirs end up in overlay's lowerdir option, where these are
	// separators or escapes.
	if strings.ContainsAny(c.Root, ":,\\\x00") {
		return fmt.Errorf("layerstore: %w: Root %q holds one of ':' ',' '\\' (overlay option syntax)", errdefs.ErrInvalid, c.Root)
	}
	return nil
}

// Store is a directory of published layers. It is safe for concurrent use
// by goroutines and by several processes sharing one Root.
type Store struct {
	root string

	// inUse holds a token per id being added by this process, so its
	// goroutines queue on a channel (honouring ctx) before they take the
	// cross-process flock.
	mu    sync.Mutex
	inUse map[string]*idLock
}

type idLock struct {
	ch   chan struct{} // capacity 1: a token held by the goroutine filling the id
	refs int
}

// New opens (creating if needed) the store at cfg.Root.
func New(cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	root := filepath.Clean(cfg.Root)
	for _, d := range []string{root, filepath.Join(root, "layers"), filepath.Join(root, "tmp"), filepath.Join(root, "locks")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("layerstore: %w", err)
		}
		// Layers may hold setuid files and device-free but otherwise
		// arbitrary trees: host users must not reach them at all.
		if err := os.Chmod(d, 0o700); err != nil {
			return nil, fmt.Errorf("layerstore: %w", err)
		}
	}
	s := &Store{root: root, inUse: map[string]*idLock{}}
	s.removeLeftovers()
	return s, nil
}

// removeLeftovers removes the tmp dirs of fillers that died (a crash, a
// kill): those whose id's flock nobody holds. A live filler holds it.
func (s *Store) removeLeftovers() {
	ents, err := os.ReadDir(filepath.Join(s.root, "tmp"))
	if err != nil {
		return
	}
	for _, e := range ents {
		name, _, ok := strings.Cut(e.Name(), ".")
		if !ok {
			continue
		}
		if _, err := dirName(strings.Replace(name, "-", ":", 1)); err != nil {
			continue
		}
		f, err := os.OpenFile(filepath.Join(s.root, "locks", name), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			continue
		}
		if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) == nil {
			_ = os.RemoveAll(filepath.Join(s.root, "tmp", e.Name()))
		}
		f.Close()
	}
}

// Root is the store's directory.
func (s *Store) Root() string { return s.root }

var idRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// dirName maps a layer id to its directory name: ':' is not welcome in
// overlay's lowerdir option (it separates layers).
func dirName(id string) (string, error) {
	if !idRE.MatchString(id) {
		return "", fmt.Errorf("layerstore: %w: layer id %q is not sha256:<64 hex>", errdefs.ErrInvalid, id)
	}
	return strings.Replace(id, ":", "-", 1), nil
}

// Dir returns the directory of published layer id; errdefs.ErrNotFound
// when it is not in the store.
func (s *Store) Dir(id string) (string, error) {
	name, err := dirName(id)
	if err != nil {
		return "", err
	}
	p := filepath.Join(s.root, "layers", name)
	fi, err := os.Lstat(p)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("layerstore: layer %s: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("layerstore: layer %s: %w", id, err)
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("layerstore: layer %s: %w: %s is not a directory", id, errdefs.ErrConflict, p)
	}
	return p, nil
}

// Add publishes layer id: when it is not yet in the store, fill populates
// a fresh empty directory (mode 0755, owned by root) which is then synced
// and renamed into place atomically. Concurrent Adds of one id, in this
// process or another sharing Root, run fill once; the others wait and
// return the published directory. When fill fails nothing is published
// and its partial tree is removed.
func (s *Store) Add(ctx context.Context, id string, fill func(dir string) error) (string, error) {
	name, err := dirName(id)
	if err != nil {
		return "", err
	}
	if d, err := s.Dir(id); err == nil {
		return d, nil
	}
	unlock, err := s.lock(ctx, name)
	if err != nil {
		return "", fmt.Errorf("layerstore: add %s: %w", id, err)
	}
	defer unlock()
	if d, err := s.Dir(id); err == nil {
		return d, nil // another filler published it while we waited
	}
	// Under the id's lock every tmp dir of this id is a leftover of a
	// filler that died (crash, kill): remove them.
	if old, _ := filepath.Glob(filepath.Join(s.root, "tmp", name+".*")); len(old) > 0 {
		for _, o := range old {
			_ = os.RemoveAll(o)
		}
	}
	tmp, err := os.MkdirTemp(filepath.Join(s.root, "tmp"), name+".")
	if err != nil {
		return "", fmt.Errorf("layerstore: add %s: %w", id, err)
	}
	published := false
	defer func() {
		if !published {
			_ = os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", fmt.Errorf("layerstore: add %s: %w", id, err)
	}
	if err := fill(tmp); err != nil {
		return "", fmt.Errorf("layerstore: add %s: %w", id, err)
	}
	if err := ctx.Err(); err != nil {
		return "", fmt.Errorf("layerstore: add %s: %w", id, err)
	}
	// One syncfs makes every file of the tree durable before the rename
	// publishes it (cheaper than an fsync per file).
	if err := syncFS(tmp); err != nil {
		return "", fmt.Errorf("layerstore: add %s: sync: %w", id, err)
	}
	final := filepath.Join(s.root, "layers", name)
	if err := os.Rename(tmp, final); err != nil {
		return "", fmt.Errorf("layerstore: add %s: publish: %w", id, err)
	}
	published = true
	if err := syncDir(filepath.Join(s.root, "layers")); err != nil {
		return "", fmt.Errorf("layerstore: add %s: sync: %w", id, err)
	}
	return final, nil
}

// lock takes the id's lock: first among this process's goroutines (a
// channel token, so waiting honours ctx), then across processes (flock,
// polled so waiting honours ctx too).
func (s *Store) lock(ctx context.Context, name string) (func(), error) {
	s.mu.Lock()
	l := s.inUse[name]
	if l == nil {
		l = &idLock{ch: make(chan struct{}, 1)}
		s.inUse[name] = l
	}
	l.refs++
	s.mu.Unlock()
	release := func() {
		s.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(s.inUse, name)
		}
		s.mu.Unlock()
	}
	select {
	case l.ch <- struct{}{}:
	case <-ctx.Done():
		release()
		return nil, ctx.Err()
	}
	f, err := os.OpenFile(filepath.Join(s.root, "locks", name), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		<-l.ch
		release()
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			<-l.ch
			release()
			return nil, fmt.Errorf("flock: %w", err)
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
			f.Close()
			<-l.ch
			release()
			return nil, ctx.Err()
		}
	}
	return func() {
		f.Close() // drops the flock
		<-l.ch
		release()
	}, nil
}

func syncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
