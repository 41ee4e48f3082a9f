// Package identity defines the execution identity of a sandbox and the
// comparator every receiver uses to decide whether a request selected for one
// execution may be served by the execution it has installed.
//
// It is pure (no I/O, no clocks) so the decision table can be tested
// exhaustively and reused by sbx-manager, netgtw and the edge alike.
package identity

import (
	"fmt"
	"slices"
	"strings"

	"github.com/spacesbx/space/internal/errdefs"
)

// Substrate names.
const (
	SubstrateNS      = "ns"
	SubstrateMicroVM = "microvm"
)

// Substrates is every substrate name a route may carry; a new substrate
// adds its name here (and nowhere else outside its package and the worker
// assembly).
var Substrates = []string{SubstrateNS, SubstrateMicroVM}

// KnownSubstrate reports whether name is one of Substrates.
func KnownSubstrate(name string) bool { return slices.Contains(Substrates, name) }

// ErrInvalidRoute marks a route that cannot identify an execution; it is
// an errdefs.ErrInvalid.
var ErrInvalidRoute = fmt.Errorf("%w: route identity", errdefs.ErrInvalid)

// Route is the identity of one selected runtime incarnation of a sandbox and
// its placement. Addresses locate endpoints; a Route decides whether an
// endpoint may serve an operation.
type Route struct {
	// SandboxID is the stable logical sandbox identity (DNS-label safe).
	SandboxID string `json:"sandbox"`
	// Generation is bumped by every new incarnation (resume elsewhere,
	// restore, restart) through a revision-guarded transaction.
	Generation uint64 `json:"generation"`
	// ExecutionID is random per incarnation.
	ExecutionID string `json:"execution"`
	// WorkerID is the worker that hosts the execution.
	WorkerID string `json:"worker"`
	// Substrate is the isolation technology ("ns", "microvm").
	Substrate string `json:"substrate"`
	// ActivationID is random per activation attempt within one execution.
	ActivationID string `json:"activation"`
	// PodUID is set only for Kubernetes residents.
	PodUID string `json:"pod_uid,omitempty"`
}

// Validate reports whether r names a concrete execution.
func (r Route) Validate() error {
	if err := ValidateSandboxID(r.SandboxID); err != nil {
		return err
	}
	switch {
	case r.Generation == 0:
		return fmt.Errorf("%w: generation must be positive", ErrInvalidRoute)
	case r.ExecutionID == "":
		return fmt.Errorf("%w: empty execution id", ErrInvalidRoute)
	case r.WorkerID == "":
		return fmt.Errorf("%w: empty worker id", ErrInvalidRoute)
	case r.Substrate == "":
		return fmt.Errorf("%w: empty substrate", ErrInvalidRoute)
	case r.ActivationID == "":
		return fmt.Errorf("%w: empty activation id", ErrInvalidRoute)
	}
	return nil
}

// String renders r for logs; it holds no secrets.
func (r Route) String() string {
	return fmt.Sprintf("%s/%d/%s@%s", r.SandboxID, r.Generation, r.ExecutionID, r.WorkerID)
}

// ExecutionLabel is the value of the Space-Execution response header:
// "<sandbox>/<generation>/<execution_id>".
func (r Route) ExecutionLabel() string {
	return fmt.Sprintf("%s/%d/%s", r.SandboxID, r.Generation, r.ExecutionID)
}

// Epoch is the part of the route identity whose change ends streams:
// everything but the activation attempt.
type Epoch struct {
	SandboxID   string
	Generation  uint64
	ExecutionID string
	WorkerID    string
	Substrate   string
	PodUID      string
}

// Epoch returns the identity epoch of r.
func (r Route) Epoch() Epoch {
	return Epoch{r.SandboxID, r.Generation, r.ExecutionID, r.WorkerID, r.Substrate, r.PodUID}
}

// ValidateSandboxID checks that id is a DNS label of lowercase letters and
// digits (hyphens allowed inside), 1..63 characters.
func ValidateSandboxID(id string) error {
	if len(id) == 0 || len(id) > 63 {
		return fmt.Errorf("%w: sandbox id must be 1..63 characters", ErrInvalidRoute)
	}
	for i, c := range id {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0 && i < len(id)-1:
		default:
			return fmt.Errorf("%w: sandbox id %q is not a lowercase DNS label", ErrInvalidRoute, id)
		}
	}
	return nil
}

// Outcome is a receiver's answer to a request's selected identity.
type Outcome int

// Outcomes. The zero value is Deny so that an unset decision fails closed.
const (
	Deny Outcome = iota
	RefreshRoute
	Allow
)

func (o Outcome) String() string {
	switch o {
	case Allow:
		return "allow"
	case RefreshRoute:
		return "refresh-route"
	default:
		return "deny"
	}
}

// Record is a receiver's locally persisted runtime record for a sandbox.
type Record struct {
	Route Route `json:"route"`
	// Retired is set once the receiver learns that the control plane
	// selected another execution; the record then serves nothing.
	Retired bool `json:"retired"`
}

// Decision is the comparator's outcome with a reason for the audit log and
// the client.
type Decision struct {
	Outcome Outcome
	Reason  string
}

// Compare decides whether a request whose capability selected `selected` may
// be served by a receiver holding `installed` (nil when the receiver has no
// record for the sandbox). endpointSandbox is the sandbox served by the
// per-sandbox endpoint the request reached (bridge or gateway); pass "" at a
// shared receiver that routes by the capability's sandbox.
//
// The table (DESIGN.md section 5):
//   - endpoint serves another sandbox: Deny
//   - no record, or a retired one: RefreshRoute
//   - record for another sandbox: Deny
//   - any identity field differs: RefreshRoute
//   - full identity equal: Allow
func Compare(selected Route, installed *Record, endpointSandbox string) Decision {
	if endpointSandbox != "" && endpointSandbox != selected.SandboxID {
		return Decision{Deny, "endpoint serves another sandbox"}
	}
	if installed == nil {
		return Decision{RefreshRoute, "no runtime record for sandbox on this receiver"}
	}
	in := installed.Route
	if in.SandboxID != selected.SandboxID {
		return Decision{Deny, "runtime record belongs to another sandbox"}
	}
	if installed.Retired {
		return Decision{RefreshRoute, "execution retired on this receiver"}
	}
	if diff := Diff(selected, in); len(diff) > 0 {
		return Decision{RefreshRoute, "identity mismatch: " + strings.Join(diff, ",")}
	}
	return Decision{Allow, "identity matches installed execution"}
}

// Diff lists the names of the fields in which a and b differ.
func Diff(a, b Route) []string {
	var d []string
	if a.SandboxID != b.SandboxID {
		d = append(d, "sandbox")
	}
	if a.Generation != b.Generation {
		d = append(d, "generation")
	}
	if a.ExecutionID != b.ExecutionID {
		d = append(d, "execution")
	}
	if a.WorkerID != b.WorkerID {
		d = append(d, "worker")
	}
	if a.Substrate != b.Substrate {
		d = append(d, "substrate")
	}
	if a.ActivationID != b.ActivationID {
		d = append(d, "activation")
	}
	if a.PodUID != b.PodUID {
		d = append(d, "pod_uid")
	}
	return d
}
