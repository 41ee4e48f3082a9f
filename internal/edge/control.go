package edge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
)

// httpError is an error answered to the client as JSON {code, message}.
type httpError struct {
	status int
	reason string
	msg    string
	// retryAfter, when set, is sent as Retry-After (seconds): the refusal
	// is about load, not about the request.
	retryAfter string
}

func (e *httpError) Error() string { return fmt.Sprintf("%d %s: %s", e.status, e.reason, e.msg) }

func badRequest(msg string) *httpError {
	return &httpError{status: http.StatusBadRequest, reason: "bad_request", msg: msg}
}

func writeError(w http.ResponseWriter, e *httpError) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if e.retryAfter != "" {
		w.Header().Set("Retry-After", e.retryAfter)
	}
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(spacev1.Error{Code: e.status, Message: e.msg, Reason: e.reason})
}

// pausedError answers a request for a paused sandbox. E2B's proxy cannot
// reach a paused sandbox and answers 502: the e2b SDK's isRunning() reports
// false on exactly that, and other calls raise its "sandbox timed out or
// paused" error. The reason tells it apart from a sandbox that is gone.
func pausedError(sandbox string) *httpError {
	return &httpError{status: http.StatusBadGateway, reason: spacev1.ReasonPaused,
		msg: "sandbox " + sandbox + " is paused: resume it (connect) and retry"}
}

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
	u := e.cfg.ControlPlaneURL + "/space/v1/sandboxes/" + url.PathEscape(t.sandbox) + "/capabilities"
	if !repair && callerToken == "" && t.sig.signature != "" {
		q := url.Values{}
		q.Set(QuerySignature, t.sig.signature)
		if t.sig.expiration != "" {
			q.Set(QuerySignatureExpiration, t.sig.expiration)
		}
		q.Set("path", t.sig.path)
		q.Set("username", t.sig.username)
		q.Set("operation", t.sig.operation)
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, bytes.NewReader(body))
	if err != nil {
		return nil, &httpError{status: http.StatusInternalServerError, reason: "internal", msg: "building capability request"}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(spacev1.HeaderAPIKey, e.cfg.EdgeKey)
	if !repair && callerToken != "" {
		if t.purpose == capability.PurposeServicePort {
			req.Header.Set(HeaderTrafficAccessToken, callerToken)
		} else {
			req.Header.Set(spacev1.HeaderAccessToken, callerToken)
		}
	}
	res, err := e.cfg.ControlPlaneClient.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		e.log.Warn("control plane unreachable", "sandbox", t.sandbox, "err", err)
		return nil, &httpError{status: http.StatusServiceUnavailable, reason: "control_plane_unavailable", msg: "control plane unreachable"}
	}
	defer res.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(res.Body, maxControlResponse))
	if err != nil {
		return nil, &httpError{status: http.StatusBadGateway, reason: "control_plane_error", msg: "reading control plane response"}
	}
	if res.StatusCode != http.StatusOK {
		var ae spacev1.Error
		msg := ""
		if json.Unmarshal(raw, &ae) == nil {
			msg = ae.Message
		}
		if res.StatusCode >= 500 {
			e.log.Warn("control plane error", "sandbox", t.sandbox, "status", res.StatusCode, "message", msg)
			return nil, &httpError{status: http.StatusBadGateway, reason: "control_plane_error", msg: "control plane error: " + orDefault(msg, http.StatusText(res.StatusCode))}
		}
		if res.StatusCode == http.StatusNotFound {
			// E2B's proxy answers 502 for a sandbox that is gone (killed,
			// timed out, never existed); the e2b SDK maps exactly that to
			// its "sandbox not found / timed out" error and isRunning()==false.
			return nil, &httpError{status: http.StatusBadGateway, reason: reasonSandboxNotFound,
				msg: "sandbox " + t.sandbox + " not found: " + orDefault(msg, "it may have been killed or timed out")}
		}
		if res.StatusCode == http.StatusConflict && ae.Reason == spacev1.ReasonPaused {
			return nil, pausedError(t.sandbox)
		}
		reason := ae.Reason
		if reason == "" {
			reason = strings.ToLower(strings.ReplaceAll(http.StatusText(res.StatusCode), " ", "_"))
		}
		return nil, &httpError{status: res.StatusCode, reason: reason, msg: orDefault(msg, http.StatusText(res.StatusCode))}
	}
	var cr spacev1.CapabilityResponse
	if err := json.Unmarshal(raw, &cr); err != nil {
		return nil, &httpError{status: http.StatusBadGateway, reason: "control_plane_error", msg: "malformed capability response"}
	}
	if cr.Token == "" || cr.Route.SandboxID != t.sandbox || cr.ExpiresAt.IsZero() {
		return nil, &httpError{status: http.StatusBadGateway, reason: "control_plane_error", msg: "incomplete capability response"}
	}
	if nu, err := url.Parse(cr.NodeURL); err != nil || (nu.Scheme != "http" && nu.Scheme != "https") || nu.Host == "" {
		return nil, &httpError{status: http.StatusBadGateway, reason: "control_plane_error", msg: "capability response names no valid node URL"}
	}
	return &cr, nil
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

// reasonSandboxNotFound marks a control-plane 404: the sandbox is gone.
const reasonSandboxNotFound = "sandbox_not_found"

// isNotFound reports whether err is a control-plane 404 (sandbox gone).
func isNotFound(err error) bool {
	var he *httpError
	return errors.As(err, &he) && he.reason == reasonSandboxNotFound
}
