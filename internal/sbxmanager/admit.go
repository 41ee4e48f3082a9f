package sbxmanager

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
)

// Admission is the outcome of checking one request.
type Admission struct {
	Decision identity.Decision
	Claims   capability.Claims
	// Err is the verification error behind a Deny, if any.
	Err error
	// act is the running activation read together with the record the
	// identity was compared with (one read of both): a request admitted
	// for an execution is forwarded only to that execution's activation.
	act *activation
}

// Admit runs the receiver checks on a capability for purpose, in order:
// parse, key, signature, purpose, time window (capability.Verifier), then
// the comparison with the locally persisted runtime record. It uses local
// state only.
func (m *Manager) Admit(token string, purpose capability.Purpose) Admission {
	return m.admit(token, func() (capability.Claims, error) { return m.ver.Verify(token, purpose) })
}

// admit runs verify (the capability checks) and then the identity
// comparison with the installed record; a missing token is a Deny.
func (m *Manager) admit(token string, verify func() (capability.Claims, error)) Admission {
	if token == "" {
		return Admission{Decision: identity.Decision{Outcome: identity.Deny, Reason: "missing capability"}}
	}
	c, err := verify()
	if err != nil {
		return Admission{Decision: identity.Decision{Outcome: identity.Deny, Reason: err.Error()}, Err: err}
	}
	// The record and the activation are read under one lock: an install,
	// retire or teardown changes both at once, so an admitted request
	// cannot find its execution gone (or a newer one) afterwards.
	m.mu.RLock()
	rec, ok := m.records[c.SandboxID]
	act := m.active[c.SandboxID]
	m.mu.RUnlock()
	var installed *identity.Record
	if ok {
		installed = &rec.Record
	}
	return Admission{Decision: identity.Compare(c.Route, installed, ""), Claims: c, act: act}
}

// ServeHTTP serves the guest API paths (/files, /process.Process/...,
// /filesystem.Filesystem/...) for every sandbox on this worker, routed by
// the capability's sandbox. Nothing is forwarded before admission.
func (m *Manager) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if isServicePort(r) {
		m.serveServicePort(w, r) // admitted here, then again at netgtw
		return
	}
	purpose, ok := capability.PurposeForEnvdPath(r.URL.Path)
	if !ok {
		m.writeError(w, fmt.Errorf("%w: no such guest API path %q", errdefs.ErrNotFound, r.URL.Path))
		return
	}
	var sandbox string
	var act *activation
	if m.cfg.UnsafeSkipIdentityChecks {
		sandbox = r.Header.Get("E2b-Sandbox-Id")
		m.mu.RLock()
		act = m.active[sandbox]
		m.mu.RUnlock()
	} else {
		ad := m.Admit(r.Header.Get(spacev1.HeaderCapability), purpose)
		if !m.judge(w, ad, purpose, r.URL.Path) {
			return
		}
		sandbox, act = ad.Claims.SandboxID, ad.act
		if act != nil && act.route != ad.Claims.Route {
			// Cannot happen while record and activation change together;
			// never forward to another execution than the admitted one.
			writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "execution replaced")
			return
		}
	}
	if m.testHookAdmitted != nil {
		m.testHookAdmitted()
	}
	if act == nil {
		// The record is live but nothing runs it: the worker restarted.
		m.writeError(w, fmt.Errorf("%w: execution of %s is installed but not active on this worker", errdefs.ErrUnavailable, sandbox))
		return
	}
	// Replaced, retired or torn down since admission: the lease has ended.
	ctx, release, ok := act.leaseContext(r.Context())
	if !ok {
		writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, "execution replaced")
		return
	}
	defer release()
	// The proxy's transport reads the request body while the response
	// streams back: without full duplex the server would discard and close
	// that body when the (flushed) response headers go out, failing the
	// transport's body write and cutting the response short.
	_ = http.NewResponseController(w).EnableFullDuplex()
	// In full duplex the handler must close an unread body itself before
	// returning, or the server's next read panics (golang/go#68560).
	defer r.Body.Close()
	if !isStream(r) {
		act.gate.RLock() // Pause waits for unary requests in flight
		defer act.gate.RUnlock()
	}
	if r.URL.Path == startPath {
		act.starts.Add(1) // before the paused check: Pause sees it or refuses it
		defer act.starts.Add(-1)
	}
	if act.paused.Load() {
		pausedError(w, sandbox) // never into a frozen guest (lifecycle.go)
		return
	}
	// A lease that ends mid-response ends it with "execution replaced".
	lw := newLeaseWriter(w, r, act)
	defer lw.finish()
	act.proxy.ServeHTTP(lw, r.WithContext(ctx))
}

// judge records an admission (audit log, metrics) and answers a refused
// request: 421 refresh-route or 403 deny. It reports whether the request
// may proceed.
func (m *Manager) judge(w http.ResponseWriter, ad Admission, purpose capability.Purpose, what string) bool {
	m.audit.record(ad, purpose, what)
	m.metrics.decisions.WithLabelValues(ad.Decision.Outcome.String()).Inc()
	switch ad.Decision.Outcome {
	case identity.Allow:
		return true
	case identity.RefreshRoute:
		writeOutcome(w, http.StatusMisdirectedRequest, spacev1.OutcomeRefreshRoute, ad.Decision.Reason)
	default:
		writeOutcome(w, http.StatusForbidden, spacev1.OutcomeDeny, ad.Decision.Reason)
	}
	return false
}

// leaseContext derives a request context that ends with the activation's
// lease, so replacing the execution cuts the request and any stream it
// opens. ok is false when the lease has already ended.
func (a *activation) leaseContext(parent context.Context) (ctx context.Context, release func(), ok bool) {
	ctx, cancel := context.WithCancel(parent)
	stop := context.AfterFunc(a.ctx, cancel)
	release = func() { stop(); cancel() }
	if a.ctx.Err() != nil {
		release()
		return nil, nil, false
	}
	return ctx, release, true
}

// startPath starts a command; Pause waits a little for these to finish.
const startPath = "/process.Process/Start"

// isStream reports whether r opens a Connect stream (process output, PTY,
// watch): those live until their lease ends and are not waited for.
func isStream(r *http.Request) bool {
	return strings.HasPrefix(r.Header.Get("Content-Type"), "application/connect+")
}

func writeOutcome(w http.ResponseWriter, status int, outcome, reason string) {
	w.Header().Set(spacev1.HeaderRouteOutcome, outcome)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(spacev1.Error{Code: status, Message: reason, Reason: outcome})
}
