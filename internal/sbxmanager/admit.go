package sbxmanager

import (
	"net/http"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/capability"
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
