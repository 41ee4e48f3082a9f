package controlplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/egress/intercept"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/netpolicy"
	"github.com/spacesbx/space/internal/store"
)

// createNetwork is the part of E2B's create body that is about the
// network: `network` (SandboxNetworkConfig) plus the top-level
// allow_internet_access.
type createNetwork struct {
	netpolicy.Spec
	AllowPublicTraffic *bool   `json:"allowPublicTraffic"`
	MaskRequestHost    *string `json:"maskRequestHost"`
	HTTPSPorts         []int   `json:"httpsPorts"`
}

// envdPort is the guest agent's port; E2B forbids listing it in httpsPorts.
const envdPort = 49983

// parseCreateNetwork reads a create request's network options into p.
func (s *Server) parseCreateNetwork(c caller, req e2bapi.NewSandbox, p *createParams) error {
	var n createNetwork
	if len(req.Network) > 0 && string(req.Network) != "null" {
		if err := json.Unmarshal(req.Network, &n); err != nil {
			return fmt.Errorf("%w: network must be an object of E2B's SandboxNetworkConfig: %v", errdefs.ErrInvalid, err)
		}
	}
	n.Spec.AllowInternetAccess = req.AllowInternetAccess
	if err := s.checkNetworkSpec(c, n.Spec); err != nil {
		return err
	}
	spec := n.Spec
	p.Network = &spec
	p.PrivateTraffic = n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic
	if n.MaskRequestHost != nil {
		if len(*n.MaskRequestHost) > 253 || containsNUL(*n.MaskRequestHost) || !validHostMask(*n.MaskRequestHost) {
			return fmt.Errorf("%w: network.maskRequestHost must be a host name (optionally with :port or ${PORT}), at most 253 bytes", errdefs.ErrInvalid)
		}
		p.MaskRequestHost = *n.MaskRequestHost
	}
	if len(n.HTTPSPorts) > 64 {
		return fmt.Errorf("%w: network.httpsPorts: at most 64 ports", errdefs.ErrInvalid)
	}
	for _, port := range n.HTTPSPorts {
		if port < 1 || port > 65535 || port == envdPort {
			return fmt.Errorf("%w: network.httpsPorts: %d is not a port a sandbox service can use", errdefs.ErrInvalid, port)
		}
	}
	p.HTTPSPorts = n.HTTPSPorts
	return nil
}

// validHostMask accepts what E2B documents for maskRequestHost: a host
// name or address, optionally with a port or the ${PORT} placeholder.
func validHostMask(h string) bool {
	if h == "" {
		return false
	}
	for _, r := range h {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		case r == '.' || r == '-' || r == ':' || r == '$' || r == '{' || r == '}' || r == '[' || r == ']' || r == '_':
		default:
			return false
		}
	}
	return true
}

// checkNetworkSpec validates a network spec and the team's limits. Secret
// references must name secrets the team has (checked again at every
// install, when they are resolved).
func (s *Server) checkNetworkSpec(c caller, spec netpolicy.Spec) error {
	if err := spec.Validate(); err != nil {
		return err
	}
	if lim, ok := s.cfg.EgressLimits[c.TeamID]; ok {
		if lim.Deny && opensEgress(spec) {
			return fmt.Errorf("%w: team %s may not open network egress (allowInternetAccess, allowOut, egressProxy)", errdefs.ErrDenied, c.TeamID)
		}
		if lim.MaxAllowOut > 0 && len(spec.AllowOut) > lim.MaxAllowOut {
			return fmt.Errorf("%w: team %s may list at most %d allowOut entries", errdefs.ErrInvalid, c.TeamID, lim.MaxAllowOut)
		}
	}
	return nil
}

// opensEgress reports whether a spec asks for any way out.
func opensEgress(spec netpolicy.Spec) bool {
	return (spec.AllowInternetAccess != nil && *spec.AllowInternetAccess) || len(spec.AllowOut) > 0 || spec.EgressProxy != nil
}

// newEgressCA gives a new sandbox its interception CA (network.rules).
// Every sandbox gets one at create, so rules added later by
// updateNetwork work without the sandbox having to trust a new CA.
func newEgressCA(rec *store.SandboxRecord) error {
	cert, key, err := intercept.NewCA(rec.ID)
	if err != nil {
		return fmt.Errorf("egress ca: %w", err)
	}
	rec.EgressCACert, rec.EgressCAKey = string(cert), string(key)
	return nil
}

// installNetwork is the network an install of rec carries: its spec with
// the team's limits applied and secrets resolved, and its CA.
func (s *Server) installNetwork(ctx context.Context, rec store.SandboxRecord) (*spacev1.Network, error) {
	var spec netpolicy.Spec
	if rec.Network != nil {
		spec = *rec.Network
	}
	if lim, ok := s.cfg.EgressLimits[rec.TeamID]; ok && lim.Deny {
		f := false
		spec = netpolicy.Spec{AllowInternetAccess: &f}
	}
	if refs := spec.SecretRefs(); len(refs) > 0 {
		secrets, err := s.st.ListSecrets(ctx, rec.TeamID)
		if err != nil {
			return nil, fmt.Errorf("network of %s: %w", rec.ID, err)
		}
		spec, err = spec.ResolveSecrets(func(name string) (string, bool) {
			for _, sec := range secrets {
				if sec.Name == name {
					return sec.Value, true
				}
			}
			return "", false
		})
		if err != nil {
			return nil, fmt.Errorf("network of %s: %w", rec.ID, err)
		}
	}
	return &spacev1.Network{Spec: spec, CACert: rec.EgressCACert, CAKey: rec.EgressCAKey}, nil
}

// networkDetail is the network part of GET /sandboxes/{id}.
func networkDetail(rec store.SandboxRecord) (*bool, *e2bapi.SandboxNetwork) {
	n := &e2bapi.SandboxNetwork{MaskRequestHost: rec.MaskRequestHost, HTTPSPorts: rec.HTTPSPorts}
	public := rec.TrafficAccessToken == ""
	n.AllowPublicTraffic = &public
	var allow *bool
	if spec := rec.Network; spec != nil {
		allow = spec.AllowInternetAccess
		n.AllowOut, n.DenyOut = spec.AllowOut, spec.DenyOut
		if len(spec.Rules) > 0 {
			n.Rules = make(map[string][]e2bapi.NetworkRule, len(spec.Rules))
			for host, rules := range spec.Rules {
				out := make([]e2bapi.NetworkRule, 0, len(rules))
				for _, r := range rules {
					var nr e2bapi.NetworkRule
					if r.Transform != nil {
						nr.Transform = &e2bapi.NetworkTransform{Headers: r.Transform.Headers}
					}
					out = append(out, nr)
				}
				n.Rules[host] = out
			}
		}
		if p := spec.EgressProxy; p != nil {
			n.EgressProxy = &e2bapi.EgressProxyInfo{Address: p.Address, Username: p.Username}
		}
	}
	return allow, n
}

// handleUpdateNetwork is E2B's PUT /sandboxes/{id}/network
// (Sandbox.updateNetwork): the egress configuration is replaced as a
// whole (omitted fields are cleared). A running sandbox's worker enforces
// it, cutting live connections it now denies, before this answers; a
// paused one gets it at resume.
func (s *Server) handleUpdateNetwork(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var spec netpolicy.Spec
	if err := decodeJSON(w, r, &spec, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.checkNetworkSpec(c, spec); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	// A lifecycle operation in flight installs the network it read at its
	// start: wait for it to end, then update (a new one is refused below).
	_, _ = s.waitSettled(r.Context(), id, capabilityWait)
	rec, _, err := s.st.MutateSandbox(r.Context(), id, func(rec *store.SandboxRecord) error {
		if !visible(*rec, c.TeamID) {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		if rec.State.Terminal() {
			return fmt.Errorf("%w: sandbox %s is %s", errdefs.ErrNotFound, id, rec.State)
		}
		if rec.State.Transitional() {
			return fmt.Errorf("%w: sandbox %s is %s; retry when it settles", errdefs.ErrConflict, id, rec.State)
		}
		next := spec
		rec.Network = &next
		return nil
	})
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	log := s.log.With("sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	if rec.State == store.StateRunning || rec.State == store.StatePaused && rec.PausedSnapshot == "" && rec.NodeURL != "" {
		nw, err := s.installNetwork(r.Context(), rec)
		if err == nil {
			err = s.node.setNetwork(r.Context(), rec.NodeURL, spacev1.NetworkRequest{Route: rec.Route, Network: *nw})
		}
		if err != nil && !(rec.State == store.StatePaused && errors.Is(err, errdefs.ErrNotFound)) {
			log.Warn("network update not applied by the worker", "err", err)
			s.writeError(w, r, fmt.Errorf("network of %s saved but not yet in force on its worker: %w", id, err))
			return
		}
	}
	log.Info("network updated", "allow_out", len(spec.AllowOut), "deny_out", len(spec.DenyOut),
		"rules", len(spec.Rules), "egress_proxy", spec.EgressProxy != nil, "open", opensEgress(spec))
	w.WriteHeader(http.StatusNoContent)
}
