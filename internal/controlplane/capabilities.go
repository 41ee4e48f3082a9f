package controlplane

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// credentials are what a capability request presents.
type credentials struct {
	APIKey      string
	AccessToken string
	// TrafficAccessToken is E2B's e2b-traffic-access-token (service ports).
	TrafficAccessToken string
	// Signature is a signed /files URL's signature, forwarded by the edge
	// instead of an access token (nil when none).
	Signature *fileSignature
}

// fileSignature is a signed /files URL (the e2b SDK's uploadUrl and
// downloadUrl of a secure sandbox), as the edge forwards it in the
// capability request's query: signature, signature_expiration (optional,
// Unix seconds), path, username and operation ("read" for GET /files,
// "write" for POST /files).
type fileSignature struct {
	Signature, Expiration, Path, Username, Operation string
}

// signatureFromQuery returns the signature the edge forwarded, or nil.
func signatureFromQuery(q url.Values) *fileSignature {
	if !q.Has("signature") {
		return nil
	}
	return &fileSignature{Signature: q.Get("signature"), Expiration: q.Get("signature_expiration"),
		Path: q.Get("path"), Username: q.Get("username"), Operation: q.Get("operation")}
}

// expectedFileSignature is envd's signature of a /files URL:
// "v1_" + unpadded base64 of sha256("path:operation:username:token"), with
// ":expiration" appended when the URL expires (the e2b SDK's getSignature).
func expectedFileSignature(path, operation, username, token, expiration string) string {
	raw := path + ":" + operation + ":" + username + ":" + token
	if expiration != "" {
		raw += ":" + expiration
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// verify checks sig against the sandbox's access token at now and returns
// until when it authorizes (zero: no expiration). Like envd, a wrong
// signature or one past its expiration is unauthenticated (401).
func (sig *fileSignature) verify(token string, now time.Time) (time.Time, error) {
	if sig.Operation != "read" && sig.Operation != "write" {
		return time.Time{}, fmt.Errorf("%w: signature operation must be read or write", errdefs.ErrUnauthenticated)
	}
	var until time.Time
	if sig.Expiration != "" {
		exp, err := strconv.ParseInt(sig.Expiration, 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("%w: invalid signature_expiration", errdefs.ErrUnauthenticated)
		}
		until = time.Unix(exp, 0)
	}
	if !equalSecret(sig.Signature, expectedFileSignature(sig.Path, sig.Operation, sig.Username, token, sig.Expiration)) {
		// envd's own words, which clients of signed URLs read.
		return time.Time{}, errdefs.Message(errdefs.ErrUnauthenticated, "invalid signature")
	}
	if !until.IsZero() && until.Unix() < now.Unix() {
		return time.Time{}, errdefs.Message(errdefs.ErrUnauthenticated, "signature is already expired")
	}
	if !until.IsZero() {
		until = until.Add(time.Second) // valid through its expiration second
	}
	return until, nil
}

// HeaderTrafficAccessToken carries a private sandbox's traffic access token.
const HeaderTrafficAccessToken = "E2b-Traffic-Access-Token"

// validatePurpose checks a caller's capability request shape.
func validatePurpose(req spacev1.CapabilityRequest) error {
	p := capability.Purpose(req.Purpose)
	switch p {
	case capability.PurposeControl:
		return fmt.Errorf("%w: control capabilities are never issued to callers", errdefs.ErrDenied)
	case capability.PurposeProcess, capability.PurposeFilesystem, capability.PurposeFiles:
		if req.Port != 0 || req.Protocol != "" {
			return fmt.Errorf("%w: port and protocol apply to service-port capabilities only", errdefs.ErrInvalid)
		}
	case capability.PurposeServicePort:
		if req.Port < 1 || req.Port > 65535 {
			return fmt.Errorf("%w: service-port needs a port 1..65535", errdefs.ErrInvalid)
		}
		switch req.Protocol {
		case "http", "ws", "tcp":
		default:
			return fmt.Errorf("%w: service-port needs protocol http, ws or tcp", errdefs.ErrInvalid)
		}
	default:
		return fmt.Errorf("%w: purpose must be process, filesystem, files or service-port", errdefs.ErrInvalid)
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
		return resp, fmt.Errorf("%w: send %s or %s", errdefs.ErrUnauthenticated, spacev1.HeaderAPIKey, spacev1.HeaderAccessToken)
	}
	var c caller
	if cred.APIKey != "" {
		var err error
		if c, err = s.authenticate(ctx, cred.APIKey); err != nil {
			return resp, err
		}
	}
	rec, _, err := s.st.GetSandbox(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return resp, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
	}
	if err != nil {
		return resp, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	tokenOK := func() bool { return rec.AccessToken != "" && equalSecret(cred.AccessToken, rec.AccessToken) }
	var callerID string
	var signedUntil time.Time // a signed URL's expiration bounds the authorization
	switch {
	case c.edge() && capability.Purpose(req.Purpose) == capability.PurposeServicePort:
		// Service ports (E2B semantics): public unless the sandbox was
		// created with private traffic; then only its traffic access token
		// authorizes (the envd access token plays no part).
		if rec.TrafficAccessToken != "" && !req.Repair && !equalSecret(cred.TrafficAccessToken, rec.TrafficAccessToken) {
			if cred.TrafficAccessToken == "" {
				return resp, fmt.Errorf("%w: sandbox %s has private traffic: send %s", errdefs.ErrDenied, id, HeaderTrafficAccessToken)
			}
			return resp, fmt.Errorf("%w: invalid traffic access token", errdefs.ErrDenied)
		}
		callerID = "edge"
	case c.edge():
		switch {
		case cred.AccessToken != "" && rec.AccessToken != "":
			if !tokenOK() {
				return resp, fmt.Errorf("%w: invalid access token", errdefs.ErrUnauthenticated)
			}
		case rec.AccessToken != "" && !req.Repair && cred.Signature != nil:
			// envd accepts a signed URL only for GET and POST /files.
			if capability.Purpose(req.Purpose) != capability.PurposeFiles {
				return resp, fmt.Errorf("%w: a signature authorizes /files only", errdefs.ErrUnauthenticated)
			}
			until, err := cred.Signature.verify(rec.AccessToken, s.now())
			if err != nil {
				return resp, err
			}
			signedUntil = until
			callerID = "edge/signature"
		case rec.AccessToken != "" && !req.Repair:
			// envd answers 401 to a secure sandbox's request without its
			// token; the e2b SDK raises AuthenticationError for it.
			return resp, fmt.Errorf("%w: sandbox %s requires its access token", errdefs.ErrUnauthenticated, id)
		}
		if callerID == "" {
			callerID = "edge"
		}
	case cred.APIKey != "":
		if rec.TeamID != c.TeamID {
			return resp, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		callerID = c.TeamID + "/" + c.KeyID
	default:
		if !tokenOK() {
			return resp, fmt.Errorf("%w: invalid access token", errdefs.ErrUnauthenticated)
		}
		callerID = rec.TeamID + "/access-token"
	}
	if req.Repair && !c.edge() {
		return resp, fmt.Errorf("%w: only the edge may request route repair", errdefs.ErrDenied)
	}
	if err := validatePurpose(req); err != nil {
		return resp, err
	}
	// The caller is authorized: a paused autoResume sandbox is resumed
	// by it (autoresume.go).
	if rec, err = s.runnable(ctx, rec); err != nil {
		return resp, err
	}
	now := s.now().UTC()
	switch {
	case rec.State.Terminal():
		return resp, fmt.Errorf("%w: sandbox %s was %s", errdefs.ErrNotFound, id, rec.State)
	case rec.State == store.StateCreating:
		return resp, fmt.Errorf("%w: sandbox %s is still starting", errdefs.ErrConflict, id)
	case rec.State == store.StatePaused:
		return resp, fmt.Errorf("%w: sandbox %s is paused; resume it first", errSandboxPaused, id)
	case !rec.EndAt.After(now):
		return resp, fmt.Errorf("%w: sandbox %s has timed out", errdefs.ErrNotFound, id)
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
	authorized := minTime(rec.EndAt, now.Add(MaxAuthorization))
	if !signedUntil.IsZero() {
		authorized = minTime(authorized, signedUntil)
	}
	return spacev1.CapabilityResponse{
		Token: tok, Route: rec.Route, NodeURL: s.nodeURL(ctx, rec), ExpiresAt: claims.Expiry,
		AuthorizedUntil: authorized, EnvdVersion: rec.EnvdVersion, MaskRequestHost: maskFor(req.Purpose, rec.MaskRequestHost),
	}, nil
}

// maskFor is the Host mask a capability response carries: service ports
// only.
func maskFor(purpose, mask string) string {
	if capability.Purpose(purpose) != capability.PurposeServicePort {
		return ""
	}
	return mask
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func (s *Server) handleCapability(w http.ResponseWriter, r *http.Request) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req spacev1.CapabilityRequest
	if err := decodeJSON(w, r, &req, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	ctx, done := traceCapability(r.Context(), id, string(req.Purpose))
	resp, err := s.issueCapability(ctx, credentials{
		APIKey: r.Header.Get(spacev1.HeaderAPIKey), AccessToken: r.Header.Get(spacev1.HeaderAccessToken),
		TrafficAccessToken: r.Header.Get(HeaderTrafficAccessToken), Signature: signatureFromQuery(r.URL.Query()),
	}, id, req)
	done(err)
	result := "issued"
	if err != nil {
		result = errdefs.Reason(err)
	}
	s.obs.capabilities.WithLabelValues(string(req.Purpose), result).Inc()
	if err != nil {
		// A paused sandbox's 409 carries reason "paused" (writeError): the
		// edge answers E2B's 502 for it and does not wait for it.
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}
