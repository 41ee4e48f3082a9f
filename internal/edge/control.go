package edge

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/telemetry"
)

// maxControlResponse bounds a control-plane answer.
const maxControlResponse = 1 << 20

// fetchCapability asks the control plane for a capability. With repair set
// it authenticates with the edge key only (the route is resolved for an
// entry the caller was already authorized for); otherwise it forwards the
// caller's access token so the control plane decides.
func (e *Edge) fetchCapability(ctx context.Context, t target, callerToken string, repair bool) (*spacev1.CapabilityResponse, error) {
	kind := "authorize"
	if repair {
		kind = "repair"
	}
	resp, err := e.doFetch(ctx, t, callerToken, repair)
	result := "ok"
	if err != nil {
		result = "error"
	}
	e.metrics.capFetches.WithLabelValues(kind, result).Inc()
	return resp, err
}

func (e *Edge) doFetch(ctx context.Context, t target, callerToken string, repair bool) (*spacev1.CapabilityResponse, error) {
	body, _ := json.Marshal(spacev1.CapabilityRequest{
		Purpose:  string(t.purpose),
		Port:     servicePort(t),
		Protocol: t.protocol,
		Repair:   repair,
	})
	path := "/space/v1/sandboxes/" + url.PathEscape(t.sandbox) + "/capabilities"
	if !repair && callerToken == "" && t.sig.signature != "" {
		path += "?" + t.sig.query().Encode()
	}
	res, err := e.cpDo(ctx, func(base string) (*http.Request, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
		if err != nil {
			return nil, fmt.Errorf("edge: building capability request: %w", err)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(spacev1.HeaderAPIKey, e.cfg.EdgeKey)
		telemetry.Inject(ctx, req.Header) // the capability's issuance joins this request's trace
		if !repair && callerToken != "" {
			if t.purpose == capability.PurposeServicePort {
				req.Header.Set(HeaderTrafficAccessToken, callerToken)
			} else {
				req.Header.Set(spacev1.HeaderAccessToken, callerToken)
			}
		}
		return req, nil
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		e.log.Warn("control plane unreachable", "sandbox", t.sandbox, "err", err)
		return nil, answer(errdefs.ErrUnavailable, "control_plane_unavailable", "control plane unreachable")
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(res.Body, maxControlResponse))
	if err != nil {
		return nil, controlPlaneError("reading control plane response")
	}
	if res.StatusCode != http.StatusOK {
		var ae spacev1.Error
		msg := ""
		if json.Unmarshal(raw, &ae) == nil {
			msg = ae.Message
		}
		// A non-200 success or redirect is no answer either: errdefs has no
		// class for it, and the client must not get it as one.
		if res.StatusCode >= 500 || res.StatusCode < 400 {
			e.log.Warn("control plane error", "sandbox", t.sandbox, "status", res.StatusCode, "message", msg)
			return nil, controlPlaneError("control plane error: " + orDefault(msg, http.StatusText(res.StatusCode)))
		}
		if res.StatusCode == http.StatusNotFound {
			// E2B's proxy answers 502 for a sandbox that is gone (killed,
			// timed out, never existed); the e2b SDK maps exactly that to
			// its "sandbox not found / timed out" error and isRunning()==false.
			return nil, answer(errdefs.ErrUpstream, reasonSandboxNotFound,
				"sandbox "+t.sandbox+" not found: "+orDefault(msg, "it may have been killed or timed out"))
		}
		if res.StatusCode == http.StatusConflict && ae.Reason == spacev1.ReasonPaused {
			return nil, pausedError(t.sandbox)
		}
		reason := ae.Reason
		if reason == "" {
			reason = strings.ToLower(strings.ReplaceAll(http.StatusText(res.StatusCode), " ", "_"))
		}
		// The control plane sends only statuses that have a class of their
		// own here (400, 401, 403, 409, 413), so the client gets the same.
		return nil, errdefs.WithReason(errdefs.FromHTTPStatus(res.StatusCode, orDefault(msg, http.StatusText(res.StatusCode))), reason)
	}
	var cr spacev1.CapabilityResponse
	if err := json.Unmarshal(raw, &cr); err != nil {
		return nil, controlPlaneError("malformed capability response")
	}
	if cr.Token == "" || cr.Route.SandboxID != t.sandbox || cr.ExpiresAt.IsZero() {
		return nil, controlPlaneError("incomplete capability response")
	}
	if nu, err := url.Parse(cr.NodeURL); err != nil || (nu.Scheme != "http" && nu.Scheme != "https") || nu.Host == "" {
		return nil, controlPlaneError("capability response names no valid node URL")
	}
	return &cr, nil
}

// cpTimeout bounds one control-plane exchange: the ControlPlaneClient's
// timeout when it has one, else DefaultControlPlaneTimeout.
func (e *Edge) cpTimeout() time.Duration {
	if d := e.cfg.ControlPlaneClient.Timeout; d > 0 {
		return d
	}
	return DefaultControlPlaneTimeout
}

func servicePort(t target) int {
	if t.port == EnvdPort {
		return 0
	}
	return t.port
}

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

// signedSandbox finds the sandbox a signed /files URL that names none was
// signed for (the e2b SDK builds uploadUrl/downloadUrl on E2B_SANDBOX_URL,
// which carries no sandbox id): the control plane knows the access tokens.
// Answers are kept (a signature belongs to one sandbox for good); at most
// signedLookups run at once, since each costs the control plane a pass
// over its secure sandboxes.
func (e *Edge) signedSandbox(ctx context.Context, sig fileSignature) (string, error) {
	key := sig.cacheToken()
	e.mu.Lock()
	id, ok := e.signed.Get(key)
	e.mu.Unlock()
	if ok {
		return id, nil
	}
	select {
	case e.lookups <- struct{}{}:
		defer func() { <-e.lookups }()
	case <-ctx.Done():
		return "", ctx.Err()
	}
	ctx, cancel := context.WithTimeout(ctx, e.cpTimeout())
	defer cancel()
	res, err := e.cpDo(ctx, func(base string) (*http.Request, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+spacev1.PathSignedFilesSandbox+"?"+sig.query().Encode(), nil)
		if err != nil {
			return nil, fmt.Errorf("edge: building signed-URL request: %w", err)
		}
		req.Header.Set(spacev1.HeaderAPIKey, e.cfg.EdgeKey)
		telemetry.Inject(ctx, req.Header) // the capability's issuance joins this request's trace
		return req, nil
	})
	if err != nil {
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		e.log.Warn("control plane unreachable", "err", err)
		return "", answer(errdefs.ErrUnavailable, "control_plane_unavailable", "control plane unreachable")
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(res.Body, maxControlResponse))
	if err != nil {
		return "", controlPlaneError("reading control plane response")
	}
	if res.StatusCode != http.StatusOK {
		var ae spacev1.Error
		_ = json.Unmarshal(raw, &ae)
		if res.StatusCode == http.StatusUnauthorized {
			return "", errdefs.WithReason(errdefs.Message(errdefs.ErrUnauthenticated, orDefault(ae.Message, "invalid signature")), "unauthorized")
		}
		e.log.Warn("control plane error", "status", res.StatusCode, "message", ae.Message)
		return "", controlPlaneError("control plane error: " + orDefault(ae.Message, http.StatusText(res.StatusCode)))
	}
	var sb spacev1.SignedFilesSandbox
	if err := json.Unmarshal(raw, &sb); err != nil || identity.ValidateSandboxID(sb.SandboxID) != nil {
		return "", controlPlaneError("malformed signed-URL answer")
	}
	e.mu.Lock()
	e.signed.Add(key, sb.SandboxID)
	e.mu.Unlock()
	return sb.SandboxID, nil
}
