//go:build !linux

// Package ns is the default SPACE substrate (Linux namespaces); on other
// systems it only provides stubs.
package ns

import (
	"context"
	"errors"

	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// MaybeInit does nothing outside Linux.
func MaybeInit() {}

// Substrate is unavailable outside Linux.
type Substrate struct{}

// New fails outside Linux.
func New(Config) (*Substrate, error) { return nil, errors.New("ns: substrate needs Linux") }

// Name returns identity.SubstrateNS.
func (*Substrate) Name() string { return identity.SubstrateNS }

// Capabilities are those of the Linux substrate.
func (*Substrate) Capabilities() substrate.Capabilities {
	return substrate.Capabilities{Netns: true}
}

// Start fails outside Linux.
func (*Substrate) Start(context.Context, substrate.Spec) (substrate.Instance, error) {
	return nil, errors.New("ns: substrate needs Linux")
}

// Close does nothing.
func (*Substrate) Close() error { return nil }
