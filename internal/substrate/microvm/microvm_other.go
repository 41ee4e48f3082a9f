//go:build !linux

// Outside Linux the microvm substrate is unavailable.

package microvm

import (
	"context"
	"errors"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// Substrate is unavailable outside Linux.
type Substrate struct{}

// New fails outside Linux.
func New(cfg Config) (*Substrate, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return nil, errors.New("microvm: substrate needs Linux")
}

// Name returns identity.SubstrateMicroVM.
func (*Substrate) Name() string { return identity.SubstrateMicroVM }

// Capabilities are those of the Linux substrate.
func (*Substrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{SavesState: true, Activation: true}
}

// Start fails outside Linux.
func (*Substrate) Start(context.Context, substrate.Spec) (substrate.Instance, error) {
	return nil, errors.New("microvm: substrate needs Linux")
}

// Close does nothing.
func (*Substrate) Close() error { return nil }
