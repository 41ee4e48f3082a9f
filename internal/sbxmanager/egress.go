package sbxmanager

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/substrate"
)

// Egress is the worker's way out for sandboxes: links into its egress
// network namespace (package sbxnet) and the proxy that enforces each
// sandbox's policy on them (package egress). internal/node builds it.
// Without one (Deps.Egress nil) every execution has loopback only,
// whatever its install asks: closed, never open.
type Egress interface {
	// AttachNetns links the network namespace of pid (an ns sandbox's
	// init) to the egress namespace.
	AttachNetns(pid int) (Link, error)
	// AttachTap makes a tap device for a VMM's NIC.
	AttachTap() (*os.File, Link, error)
	// Apply puts an execution's policy in force on l; connections the new
	// policy denies are closed before it returns. Until the first Apply
	// of a link nothing it sends gets out.
	Apply(l Link, route identity.Route, nw spacev1.Network) error
	// Release forgets l's policy (closing its connections) and removes
	// the link. Gone is not an error.
	Release(l Link) error
	// Resolver is what a guest names as its nameserver: every port-53
	// packet from a link reaches the worker's resolver whatever its
	// destination, so one address serves every sandbox.
	Resolver() netip.Addr
	// InUse lists the slots whose links exist (sweep at start).
	InUse() ([]int, error)
}

// Link is one execution's link, as recorded: the slot it holds in the
// worker's address pool and the addresses that slot gives.
type Link struct {
	Slot    int          `json:"slot"`
	Gateway netip.Addr   `json:"gateway"`
	Addr    netip.Prefix `json:"addr"`
	MAC     string       `json:"mac,omitempty"`
}

// linkBeforeStart makes a tap for a substrate whose NIC is a tap, before
// its instance starts; for the others the link is made after Start
// (linkAfterStart).
func (m *Manager) linkBeforeStart(rec *record, caps substrate.Capabilities, spec *substrate.Spec) (*os.File, error) {
	if m.egress == nil || rec.Network == nil || !caps.Tap {
		return nil, nil
	}
	tap, l, err := m.egress.AttachTap()
	if err != nil {
		return nil, fmt.Errorf("egress link: %w", err)
	}
	rec.Link = &l
	mac, _ := parseMAC(l.MAC)
	spec.Network = &substrate.Network{Addr: l.Addr, Gateway: l.Gateway, Tap: tap, MAC: mac}
	return tap, nil
}

// linkAfterStart links an ns sandbox's network namespace once its init
// runs.
func (m *Manager) linkAfterStart(rec *record, caps substrate.Capabilities, inst substrate.Instance) error {
	if m.egress == nil || rec.Network == nil || caps.Tap || !caps.Netns {
		return nil
	}
	l, err := m.egress.AttachNetns(inst.InitPID())
	if err != nil {
		return fmt.Errorf("egress link: %w", err)
	}
	rec.Link = &l
	return nil
}

// applyNetwork puts rec's policy in force on its link.
func (m *Manager) applyNetwork(rec record) error {
	if m.egress == nil || rec.Link == nil || rec.Network == nil {
		return nil
	}
	if err := m.egress.Apply(*rec.Link, rec.Route, *rec.Network); err != nil {
		return fmt.Errorf("egress policy of %s: %w", rec.Route.SandboxID, err)
	}
	return nil
}

// releaseLink removes rec's link (the execution stopped or is not adopted).
func (m *Manager) releaseLink(rec record) {
	if m.egress == nil || rec.Link == nil {
		return
	}
	if err := m.egress.Release(*rec.Link); err != nil {
		m.log.Warn("releasing an egress link", "sandbox", rec.Route.SandboxID, "slot", rec.Link.Slot, "err", err)
	}
}

func parseMAC(s string) (net.HardwareAddr, error) {
	if s == "" {
		return nil, nil
	}
	return net.ParseMAC(s)
}

// guestNetwork is the guest's side of rec's link (nil without one).
func (m *Manager) guestNetwork(rec record, caps substrate.Capabilities) *guestNetworkConfig {
	if m.egress == nil || rec.Network == nil {
		return nil
	}
	g := &guestNetworkConfig{DNS: m.egress.Resolver().String(), CACert: rec.Network.CACert}
	if rec.Link != nil && caps.Tap {
		g.Address, g.Gateway, g.MAC = rec.Link.Addr.String(), rec.Link.Gateway.String(), rec.Link.MAC
		g.DNS = rec.Link.Gateway.String()
	}
	return g
}

// guestNetworkConfig is guest.NetworkConfig on the wire (the manager does
// not link the guest package).
type guestNetworkConfig struct {
	Address string `json:"address,omitempty"`
	Gateway string `json:"gateway,omitempty"`
	DNS     string `json:"dns"`
	MAC     string `json:"mac,omitempty"`
	CACert  string `json:"ca_cert,omitempty"`
}

// SetNetwork replaces the egress policy of the installed execution named
// by route (E2B updateNetwork): persisted first, then in force, before it
// returns.
func (m *Manager) SetNetwork(ctx context.Context, route identity.Route, nw spacev1.Network) error {
	unlock := m.lockSandbox(route.SandboxID)
	defer unlock()
	m.mu.RLock()
	rec, ok := m.records[route.SandboxID]
	m.mu.RUnlock()
	if !ok || rec.Retired {
		return fmt.Errorf("network %s: %w", route.SandboxID, errdefs.ErrNotFound)
	}
	if rec.Route.Epoch() != route.Epoch() {
		return fmt.Errorf("network %s: %w: installed execution is %s", route.SandboxID, errdefs.ErrConflict, rec.Route)
	}
	if rec.Network == nil || rec.Link == nil || m.egress == nil {
		return fmt.Errorf("network %s: %w: the execution was installed without an egress link", route.SandboxID, errdefs.ErrConflict)
	}
	next := rec
	next.Network = &nw
	if err := m.store.put(next); err != nil {
		return fmt.Errorf("network %s: persist record: %w", route.SandboxID, err)
	}
	m.mu.Lock()
	if cur, ok := m.records[route.SandboxID]; ok && cur.Route == rec.Route {
		m.records[route.SandboxID] = next
	}
	m.mu.Unlock()
	if err := m.applyNetwork(next); err != nil {
		return err
	}
	m.log.Info("egress policy replaced", "sandbox", route.SandboxID, "generation", route.Generation)
	return nil
}

// sweepLinks removes links that no record names (an install cut off
// between the link and the record).
func (m *Manager) sweepLinks() {
	if m.egress == nil {
		return
	}
	slots, err := m.egress.InUse()
	if err != nil {
		m.log.Warn("listing egress links", "err", err)
		return
	}
	named := map[int]bool{}
	for _, r := range m.records {
		if r.Link != nil && !r.Retired {
			named[r.Link.Slot] = true
		}
	}
	for _, s := range slots {
		if named[s] {
			continue
		}
		if err := m.egress.Release(Link{Slot: s}); err != nil {
			m.log.Warn("removing an egress link no record names", "slot", s, "err", err)
			continue
		}
		m.log.Info("removed an egress link no record names", "slot", s)
	}
}
