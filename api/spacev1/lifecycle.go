package spacev1

import (
	"time"

	"github.com/spacesbx/space/internal/identity"
)

// MigrateRequest is the body of POST /space/v1/sandboxes/{id}/migrate.
type MigrateRequest struct {
	// TargetWorker names the worker to move to; empty lets the scheduler
	// pick one (never the current worker).
	TargetWorker string `json:"target_worker,omitempty"`
}

// MigrateResponse answers a migration (and is what a resume elsewhere did).
type MigrateResponse struct {
	SandboxID string         `json:"sandbox_id"`
	From      identity.Route `json:"from"`
	Route     identity.Route `json:"route"`
	// Execution is the new execution's history entry.
	Execution  Execution `json:"execution"`
	SnapshotID string    `json:"snapshot_id"`
	// ProcessesRestarted and FilesKept describe what the move preserved:
	// the ns substrate archives the writable layer only; the microvm
	// substrate's snapshot holds the whole machine (processes kept).
	ProcessesRestarted bool   `json:"processes_restarted"`
	FilesKept          bool   `json:"files_kept"`
	Note               string `json:"note"`
}

// RotateResponse answers POST /space/v1/keys/rotate.
type RotateResponse struct {
	KeyID            string    `json:"kid"`
	PreviousKeyID    string    `json:"previous_kid"`
	PreviousNotAfter time.Time `json:"previous_not_after"`
	BundleRevision   int64     `json:"bundle_revision"`
	// Keys lists the ids in the published bundle.
	Keys []string `json:"keys"`
}
