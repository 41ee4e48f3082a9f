//go:build !linux

package volume

import (
	"context"
	"fmt"
	"log/slog"

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
