package controlplane

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/store"
)

// credentials are what a capability request presents.
type credentials struct {
	APIKey      string
	AccessToken string
	// TrafficAccessToken is E2B's e2b-traffic-access-token (service ports).
	TrafficAccessToken string
}

// HeaderTrafficAccessToken carries a private sandbox's traffic access token.
const HeaderTrafficAccessToken = "E2b-Traffic-Access-Token"

// validatePurpose checks a caller's capability request shape.
func validatePurpose(req spacev1.CapabilityRequest) error {
	p := capability.Purpose(req.Purpose)
	switch p {
	case capability.PurposeControl:
		return fmt.Errorf("%w: control capabilities are never issued to callers", ErrDenied)
	case capability.PurposeProcess, capability.PurposeFilesystem, capability.PurposeFiles:
		if req.Port != 0 || req.Protocol != "" {
			return fmt.Errorf("%w: port and protocol apply to service-port capabilities only", ErrInvalid)
		}
	case capability.PurposeServicePort:
		if req.Port < 1 || req.Port > 65535 {
			return fmt.Errorf("%w: service-port needs a port 1..65535", ErrInvalid)
		}
		switch req.Protocol {
		case "http", "ws", "tcp":
		default:
			return fmt.Errorf("%w: service-port needs protocol http, ws or tcp", ErrInvalid)
		}
	default:
		return fmt.Errorf("%w: purpose must be process, filesystem, files or service-port", ErrInvalid)
	}
	return nil
}

// issueCapability authorizes the caller for sandbox id and signs a
// capability for its current execution.
//
// Authorization: an API key of the sandbox's team; or the sandbox's access
// token (X-Access-Token, compared in constant time); or the edge's service
// key, alone only for sandboxes without an access token or for repair
// requests. Only the edge key may set Repair.
func (s *Server) issueCapability(ctx context.Context, cred credentials, id string, req spacev1.CapabilityRequest) (spacev1.CapabilityResponse, error) {
	var resp spacev1.CapabilityResponse
	if cred.APIKey == "" && cred.AccessToken == "" {
		return resp, fmt.Errorf("%w: send %s or %s", ErrUnauthenticated, spacev1.HeaderAPIKey, spacev1.HeaderAccessToken)
	}
	var c caller
	if cred.APIKey != "" {
		var err error
		if c, err = s.authenticate(ctx, cred.APIKey); err != nil {
			return resp, err
		}
	}
	rec, _, err := s.st.GetSandbox(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		return resp, fmt.Errorf("%w: sandbox %s", ErrNotFound, id)
	}
	if err != nil {
		return resp, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	tokenOK := func() bool { return rec.AccessToken != "" && equalSecret(cred.AccessToken, rec.AccessToken) }
	var callerID string
	switch {
	case c.edge() && capability.Purpose(req.Purpose) == capability.PurposeServicePort:
		// Service ports (E2B semantics): public unless the sandbox was
		// created with private traffic; then only its traffic access token
		// authorizes (the envd access token plays no part).
		if rec.TrafficAccessToken != "" && !req.Repair && !equalSecret(cred.TrafficAccessToken, rec.TrafficAccessToken) {
			if cred.TrafficAccessToken == "" {
				return resp, fmt.Errorf("%w: sandbox %s has private traffic: send %s", ErrDenied, id, HeaderTrafficAccessToken)
			}
			return resp, fmt.Errorf("%w: invalid traffic access token", ErrDenied)
		}
		callerID = "edge"
	case c.edge():
		switch {
		case cred.AccessToken != "" && rec.AccessToken != "":
			if !tokenOK() {
				return resp, fmt.Errorf("%w: invalid access token", ErrUnauthenticated)
			}
		case rec.AccessToken != "" && !req.Repair:
			return resp, fmt.Errorf("%w: sandbox %s requires its access token", ErrDenied, id)
		}
		callerID = "edge"
	case cred.APIKey != "":
		if rec.TeamID != c.TeamID {
			return resp, fmt.Errorf("%w: sandbox %s", ErrNotFound, id)
		}
		callerID = c.TeamID + "/" + c.KeyID
	default:
		if !tokenOK() {
			return resp, fmt.Errorf("%w: invalid access token", ErrUnauthenticated)
		}
		callerID = rec.TeamID + "/access-token"
	}
	if req.Repair && !c.edge() {
		return resp, fmt.Errorf("%w: only the edge may request route repair", ErrDenied)
	}
	if err := validatePurpose(req); err != nil {
		return resp, err
	}
	now := s.now().UTC()
	switch {
	case rec.State.Terminal():
		return resp, fmt.Errorf("%w: sandbox %s was %s", ErrNotFound, id, rec.State)
	case rec.State == store.StateCreating:
		return resp, fmt.Errorf("%w: sandbox %s is still starting", ErrConflict, id)
	case rec.State == store.StatePaused:
		return resp, fmt.Errorf("%w: sandbox %s is paused; resume it first", ErrConflict, id)
	case !rec.EndAt.After(now):
		return resp, fmt.Errorf("%w: sandbox %s has timed out", ErrNotFound, id)
	}
	exp := minTime(now.Add(capability.Lifetime), rec.EndAt)
	tok, claims, err := s.signer.Issue(capability.Claims{
		Route: rec.Route, Purpose: capability.Purpose(req.Purpose), Port: req.Port, Protocol: req.Protocol,
		Caller: callerID, IssuedAt: now, Expiry: exp,
	})
	if err != nil {
		return resp, fmt.Errorf("issue capability: %w", err)
	}
	s.log.Debug("capability issued", "sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID,
		"purpose", req.Purpose, "caller", callerID, "repair", req.Repair, "jti", claims.JTI)
	return spacev1.CapabilityResponse{
		Token: tok, Route: rec.Route, NodeURL: s.nodeURL(ctx, rec), ExpiresAt: claims.Expiry,
		AuthorizedUntil: minTime(rec.EndAt, now.Add(MaxAuthorization)), EnvdVersion: rec.EnvdVersion,
	}, nil
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
