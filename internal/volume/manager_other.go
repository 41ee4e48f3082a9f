//go:build !linux

package volume

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/spacesbx/space/internal/errdefs"
)

// Config configures a worker's volumes (Linux only).
type Config struct {
	Root      string
	SizeBytes int64
	Logger    *slog.Logger
}

// Manager is unavailable off Linux.
type Manager struct{}

// Unsupported says why volumes cannot be used here.
func Unsupported() string { return "volumes need Linux (loop devices, ext4, idmapped mounts)" }

// New fails off Linux.
func New(Config) (*Manager, error) {
	return nil, fmt.Errorf("volume: %w: %s", errdefs.ErrUnavailable, Unsupported())
}

func (m *Manager) Acquire(context.Context, string) (string, func(), error) {
	return "", nil, fmt.Errorf("volume: %w", errdefs.ErrUnavailable)
}
func (m *Manager) Delete(context.Context, string) error {
	return fmt.Errorf("volume: %w", errdefs.ErrUnavailable)
}
func (m *Manager) Close() error { return nil }

func (m *Manager) Collect(context.Context, func(context.Context) (map[string]bool, error)) ([]string, error) {
	return nil, nil
}

// Dir is unavailable off Linux.
type Dir struct{}

func (m *Manager) OpenDir(context.Context, string) (*Dir, error) {
	return nil, fmt.Errorf("volume: %w", errdefs.ErrUnavailable)
}
func (d *Dir) Close()                                   {}
func (d *Dir) Stat(string) (Entry, error)               { return Entry{}, errdefs.ErrUnavailable }
func (d *Dir) List(string, int) ([]Entry, error)        { return nil, errdefs.ErrUnavailable }
func (d *Dir) Mkdir(string, Attrs, bool) (Entry, error) { return Entry{}, errdefs.ErrUnavailable }
func (d *Dir) SetAttrs(string, Attrs) (Entry, error)    { return Entry{}, errdefs.ErrUnavailable }
func (d *Dir) Remove(string) error                      { return errdefs.ErrUnavailable }
func (d *Dir) Open(string) (*os.File, error)            { return nil, errdefs.ErrUnavailable }
func (d *Dir) WriteFile(string, io.Reader, Attrs, int64) (Entry, error) {
	return Entry{}, errdefs.ErrUnavailable
}
