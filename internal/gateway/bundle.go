package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/spacesbx/space/internal/capability"
)

// ReadBundle reads a key bundle file (the worker's on-disk bundle cache,
// written atomically by rename).
func ReadBundle(path string) (capability.Bundle, error) {
	var b capability.Bundle
	data, err := os.ReadFile(path)
	if err != nil {
		return b, err
	}
	if err := json.Unmarshal(data, &b); err != nil {
		return b, fmt.Errorf("bundle %s: %w", path, err)
	}
	return b, b.Validate()
}

type fileStamp struct {
	ino, size uint64
	mtime     time.Time
}

func stampOf(path string) (fileStamp, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, false
	}
	s := fileStamp{size: uint64(fi.Size()), mtime: fi.ModTime()}
	if st, ok := statIno(fi); ok {
		s.ino = st
	}
	return s, true
}

// WatchBundle keeps ver current with the bundle file at path: it installs
// the file's bundle whenever the file changes (checked every interval)
// until ctx ends. SetBundle ignores older revisions and flushes the
// verified-token cache on change.
func WatchBundle(ctx context.Context, path string, ver *capability.Verifier, interval time.Duration, log *slog.Logger) {
	if interval <= 0 {
		interval = 500 * time.Millisecond
	}
	last, _ := stampOf(path)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s, ok := stampOf(path)
		if !ok || s == last {
			continue
		}
		b, err := ReadBundle(path)
		if err != nil {
			log.Warn("key bundle unreadable; keeping the installed one", "err", err)
			continue
		}
		last = s
		if err := ver.SetBundle(b); err != nil {
			log.Warn("key bundle rejected", "err", err)
			continue
		}
		log.Info("key bundle installed", "revision", ver.Revision(), "keys", len(b.Keys))
	}
}
