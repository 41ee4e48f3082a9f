package sbxmanager

import (
	"fmt"
	"log/slog"
	"os"

	"github.com/spacesbx/space/internal/capability"
	"github.com/spacesbx/space/internal/identity"
)

// auditLog records every admission decision as a JSON line. It names the
// token by its jti only; tokens themselves are never written.
type auditLog struct {
	f   *os.File
	log *slog.Logger
}

func openAudit(path, worker string) (*auditLog, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open audit log: %w", err)
	}
	return &auditLog{f: f, log: slog.New(slog.NewJSONHandler(f, nil)).With("worker", worker)}, nil
}

func (a *auditLog) record(ad Admission, purpose capability.Purpose, path string) {
	c := ad.Claims
	a.log.Info("admission",
		"outcome", ad.Decision.Outcome.String(), "reason", ad.Decision.Reason,
		"purpose", string(purpose), "path", path,
		"sandbox", c.SandboxID, "generation", c.Generation, "execution", c.ExecutionID,
		"jti", c.JTI, "caller", c.Caller)
}

// lost records a decision about an execution whose processes are gone:
// "reclaimed" (its leftovers ended at the worker's start), "lost" (its
// init exited while served), "unrecoverable" (its files lived in its
// memory: a microVM without a layer disk), "layer-saved" (a microVM's
// layer disk saved for its recovery), with the error that stopped it, if
// any.
func (a *auditLog) lost(decision string, r identity.Route, err error) {
	args := []any{"decision", decision, "sandbox", r.SandboxID, "generation", r.Generation, "execution", r.ExecutionID, "activation", r.ActivationID}
	if err != nil {
		args = append(args, "err", err.Error())
	}
	a.log.Info("lost execution", args...)
}

func (a *auditLog) close() error { return a.f.Close() }

// EgressDenial is one connection or DNS query a sandbox's egress policy
// refused, for the audit log.
type EgressDenial struct {
	SandboxID  string
	Generation uint64
	// Kind is "tcp" or "dns"; Dest the destination (ip:port, or the
	// queried name); Name the TLS SNI or HTTP Host when known.
	Kind, Dest, Name, Reason string
}

// AuditEgress writes an egress denial to the audit log.
func (m *Manager) AuditEgress(d EgressDenial) {
	m.audit.log.Info("egress denied", "sandbox", d.SandboxID, "generation", d.Generation,
		"kind", d.Kind, "dest", d.Dest, "name", d.Name, "reason", d.Reason)
}
