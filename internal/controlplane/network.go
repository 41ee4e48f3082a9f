package controlplane

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/internal/errdefs"
)

// handleUpdateNetwork is E2B's PUT /sandboxes/{id}/network
// (Sandbox.updateNetwork): sandboxes have loopback-only networking and no
// egress path exists, so a policy that would open egress is refused as
// invalid; one that keeps egress closed is accepted (it is what the sandbox
// already enforces).
func (s *Server) handleUpdateNetwork(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		AllowInternetAccess *bool           `json:"allow_internet_access"`
		AllowOut            []string        `json:"allowOut"`
		DenyOut             []string        `json:"denyOut"`
		EgressProxy         json.RawMessage `json:"egressProxy"`
		Rules               json.RawMessage `json:"rules"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if _, err := s.getSandbox(r.Context(), c, id); err != nil {
		s.writeError(w, r, err)
		return
	}
	switch {
	case req.AllowInternetAccess != nil && *req.AllowInternetAccess,
		len(req.AllowOut) > 0,
		len(req.EgressProxy) > 0 && string(req.EgressProxy) != "null":
		s.writeError(w, r, fmt.Errorf("%w: sandboxes have loopback-only networking; egress (allow_internet_access, allowOut, egressProxy) cannot be opened", errdefs.ErrInvalid))
		return
	}
	// Deny rules and transform rules describe traffic that cannot leave.
	w.WriteHeader(http.StatusNoContent)
}
