package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/netpolicy"
)

// SandboxState is the lifecycle state of a sandbox record.
type SandboxState string

// Sandbox states.
const (
	// StateCreating: record written, install on the worker under way.
	StateCreating SandboxState = "creating"
	StateRunning  SandboxState = "running"
	StatePaused   SandboxState = "paused"
	// Transitional states: one lifecycle operation (SandboxRecord.Op) is
	// in flight. No capability is issued while a record is in one of them.
	StatePausing      SandboxState = "pausing"
	StateResuming     SandboxState = "resuming"
	StateMigrating    SandboxState = "migrating"
	StateSnapshotting SandboxState = "snapshotting"
	// StateKilled and StateFailed are tombstones: the id is never reused,
	// the executions history stays readable until the record is purged.
	StateKilled SandboxState = "killed"
	StateFailed SandboxState = "failed"
)

// Terminal reports whether s is a tombstone state.
func (s SandboxState) Terminal() bool { return s == StateKilled || s == StateFailed }

// Transitional reports whether a lifecycle operation holds the record.
func (s SandboxState) Transitional() bool {
	return s == StatePausing || s == StateResuming || s == StateMigrating || s == StateSnapshotting
}

// LifecycleOp is the lifecycle operation that holds a record in a
// transitional state. Only the operation with this ID may move the record
// out of it (every step is a revision-guarded write that re-checks the ID).
type LifecycleOp struct {
	ID   string `json:"id"`
	Kind string `json:"kind"`
	// From is the stable state (running or paused) the operation started in.
	From      SandboxState `json:"from"`
	StartedAt time.Time    `json:"started_at"`
	// Target is the requested target worker, if any.
	Target string `json:"target,omitempty"`
	// Owner is the control plane instance running the operation
	// (RegisterControlPlane); empty in records written before owners.
	Owner string `json:"owner,omitempty"`
}

// SandboxRecord is the control plane's durable record of one sandbox.
//
// AccessToken and EnvVars may hold secrets: the record's LogValue omits
// them, never log the struct with %v.
type SandboxRecord struct {
	ID         string            `json:"id"`
	TeamID     string            `json:"team_id"`
	KeyID      string            `json:"key_id,omitempty"`
	TemplateID string            `json:"template_id"`
	Alias      string            `json:"alias,omitempty"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	EnvVars    map[string]string `json:"env_vars,omitempty"`
	// AccessToken is the envd access token (E2B's "secure" sandboxes);
	// empty when the sandbox has none.
	AccessToken string `json:"access_token,omitempty"`
	// TrafficAccessToken guards service-port traffic of sandboxes created
	// with private traffic (e2b-traffic-access-token); empty: public ports.
	TrafficAccessToken string       `json:"traffic_access_token,omitempty"`
	State              SandboxState `json:"state"`
	// Route is the current (or last) execution's identity.
	Route identity.Route `json:"route"`
	// Generation is the highest generation ever assigned to this sandbox.
	Generation uint64 `json:"generation"`
	// NodeURL is the node-api base URL of Route.WorkerID at install time.
	NodeURL     string    `json:"node_url,omitempty"`
	EnvdVersion string    `json:"envd_version,omitempty"`
	CPUCount    int       `json:"cpu_count,omitempty"`
	MemoryMB    int       `json:"memory_mb,omitempty"`
	DiskSizeMB  int       `json:"disk_size_mb,omitempty"`
	AutoPause   bool      `json:"auto_pause,omitempty"`
	CreatedAt   time.Time `json:"created_at"`
	// Creator is the control plane instance that ran the create
	// (RegisterControlPlane); the reaper reads it while the record is
	// creating.
	Creator   string    `json:"creator,omitempty"`
	StartedAt time.Time `json:"started_at,omitzero"`
	// EndAt is when the sandbox times out.
	EndAt time.Time `json:"end_at"`
	// EndedAt is when it was killed or failed.
	EndedAt time.Time `json:"ended_at,omitzero"`
	// Reason explains a kill or failure.
	Reason     string              `json:"reason,omitempty"`
	Executions []spacev1.Execution `json:"executions,omitempty"`
	// Op is the lifecycle operation in flight (set exactly when State is
	// transitional).
	Op *LifecycleOp `json:"op,omitempty"`
	// PendingRoute is the next execution while it is being installed (its
	// generation is already reserved in Generation). It is not published:
	// no capability names it and workers must not treat it as the current
	// route until it becomes Route.
	PendingRoute *identity.Route `json:"pending_route,omitempty"`
	// PausedSnapshot is a snapshot of Route's writable layer taken while
	// Route stayed paused (so it is still current); empty otherwise.
	PausedSnapshot string `json:"paused_snapshot,omitempty"`
	// Network is the sandbox's egress configuration as the API last set
	// it (secret placeholders unresolved); nil: none given (the
	// operator's default applies).
	Network *netpolicy.Spec `json:"network,omitempty"`
	// Image is the OCI image the sandbox's root file system comes from
	// (a template built fromImage); nil: the template's own.
	Image *spacev1.ImageSource `json:"image,omitempty"`
	// EgressCACert and EgressCAKey are the sandbox's interception CA
	// (network.rules); the key never reaches the sandbox or the API.
	EgressCACert string `json:"egress_ca_cert,omitempty"`
	EgressCAKey  string `json:"egress_ca_key,omitempty"`
	// MaskRequestHost and HTTPSPorts are E2B's ingress options.
	MaskRequestHost string `json:"mask_request_host,omitempty"`
	HTTPSPorts      []int  `json:"https_ports,omitempty"`
	// VolumeMounts are the team volumes every execution mounts (E2B
	// volumeMounts, resolved to volume ids at create).
	VolumeMounts []spacev1.VolumeMount `json:"volume_mounts,omitempty"`

	// AutoResume: traffic to the paused sandbox resumes it (E2B's
	// lifecycle.autoResume); ResumeTimeout is then its time to live from
	// the resume (the create's timeout).
	AutoResume    bool          `json:"auto_resume,omitempty"`
	ResumeTimeout time.Duration `json:"resume_timeout,omitempty"`
}

// LogValue renders the record without secrets.
func (r SandboxRecord) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("sandbox", r.ID),
		slog.String("team", r.TeamID),
		slog.String("state", string(r.State)),
		slog.Uint64("generation", r.Route.Generation),
		slog.String("worker", r.Route.WorkerID),
	)
}

// Validate checks what the store requires of a record.
func (r SandboxRecord) Validate() error {
	if err := identity.ValidateSandboxID(r.ID); err != nil {
		return fmt.Errorf("%w: %v", errdefs.ErrInvalid, err)
	}
	if r.TeamID == "" {
		return fmt.Errorf("%w: sandbox %s has no team", errdefs.ErrInvalid, r.ID)
	}
	switch r.State {
	case StateCreating, StateRunning, StatePaused, StateKilled, StateFailed,
		StatePausing, StateResuming, StateMigrating, StateSnapshotting:
	default:
		return fmt.Errorf("%w: sandbox %s has unknown state %q", errdefs.ErrInvalid, r.ID, r.State)
	}
	if r.State.Transitional() != (r.Op != nil) {
		return fmt.Errorf("%w: sandbox %s: state %s with operation %v", errdefs.ErrInvalid, r.ID, r.State, r.Op != nil)
	}
	if p := r.PendingRoute; p != nil && (p.SandboxID != r.ID || p.Generation > r.Generation || p.Generation <= r.Route.Generation) {
		return fmt.Errorf("%w: sandbox %s: pending route generation %d outside (%d, %d]", errdefs.ErrInvalid, r.ID, p.Generation, r.Route.Generation, r.Generation)
	}
	if r.Route.SandboxID != "" && r.Route.SandboxID != r.ID {
		return fmt.Errorf("%w: sandbox %s route names sandbox %q", errdefs.ErrInvalid, r.ID, r.Route.SandboxID)
	}
	if r.Route.Generation > r.Generation {
		return fmt.Errorf("%w: sandbox %s route generation %d above counter %d", errdefs.ErrInvalid, r.ID, r.Route.Generation, r.Generation)
	}
	return nil
}

func sandboxKey(id string) string { return sandboxesPrefix + id }

// CreateSandbox writes a new record and returns its mod revision. It fails
// with errdefs.ErrConflict if a record with that id exists (ids are never reused).
func (s *Store) CreateSandbox(ctx context.Context, rec SandboxRecord) (int64, error) {
	if err := rec.Validate(); err != nil {
		return 0, fmt.Errorf("store: create sandbox: %w", err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return 0, fmt.Errorf("store: encode sandbox: %w", err)
	}
	k := sandboxKey(rec.ID)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(data))).
		Commit()
	if err != nil {
		return 0, wrapErr("create sandbox", err)
	}
	if !resp.Succeeded {
		return 0, fmt.Errorf("store: create sandbox %s: %w: already exists", rec.ID, errdefs.ErrConflict)
	}
	return resp.Header.Revision, nil
}

// GetSandbox returns the record and its mod revision, or errdefs.ErrNotFound.
func (s *Store) GetSandbox(ctx context.Context, id string) (SandboxRecord, int64, error) {
	if err := identity.ValidateSandboxID(id); err != nil {
		return SandboxRecord{}, 0, fmt.Errorf("store: get sandbox: %w: %v", errdefs.ErrInvalid, err)
	}
	resp, err := s.cli.Get(ctx, sandboxKey(id))
	if err != nil {
		return SandboxRecord{}, 0, wrapErr("get sandbox", err)
	}
	if len(resp.Kvs) == 0 {
		return SandboxRecord{}, 0, fmt.Errorf("store: sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	var rec SandboxRecord
	if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
		return SandboxRecord{}, 0, fmt.Errorf("store: decode sandbox %s: %w", id, err)
	}
	return rec, resp.Kvs[0].ModRevision, nil
}

// encodeUpdate checks an update's arguments (UpdateSandbox,
// UpdateSandboxPlaced) and encodes the record.
func encodeUpdate(id string, expectRevision int64, rec SandboxRecord) ([]byte, error) {
	if rec.ID != id {
		return nil, fmt.Errorf("store: update sandbox %s: %w: record names %q", id, errdefs.ErrInvalid, rec.ID)
	}
	if expectRevision <= 0 {
		return nil, fmt.Errorf("store: update sandbox %s: %w: expected revision must be positive", id, errdefs.ErrInvalid)
	}
	if err := rec.Validate(); err != nil {
		return nil, fmt.Errorf("store: update sandbox: %w", err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return nil, fmt.Errorf("store: encode sandbox: %w", err)
	}
	return data, nil
}

// UpdateSandbox replaces the record if its mod revision is still
// expectRevision and returns the new revision. It fails with errdefs.ErrConflict when
// the record moved since the caller read it (so two operations that both read
// generation N can never both write N+1), and errdefs.ErrNotFound when it is gone.
func (s *Store) UpdateSandbox(ctx context.Context, id string, expectRevision int64, rec SandboxRecord) (int64, error) {
	data, err := encodeUpdate(id, expectRevision, rec)
	if err != nil {
		return 0, err
	}
	k := sandboxKey(id)
	resp, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision)).
		Then(clientv3.OpPut(k, string(data))).
		Else(clientv3.OpGet(k, clientv3.WithCountOnly())).
		Commit()
	if err != nil {
		return 0, wrapErr("update sandbox", err)
	}
	if !resp.Succeeded {
		if len(resp.Responses) > 0 && resp.Responses[0].GetResponseRange().GetCount() == 0 {
			return 0, fmt.Errorf("store: update sandbox %s: %w", id, errdefs.ErrNotFound)
		}
		return 0, fmt.Errorf("store: update sandbox %s: %w: revision moved since %d", id, errdefs.ErrConflict, expectRevision)
	}
	return resp.Header.Revision, nil
}

// MutateSandbox reads the record, applies fn and writes the result with
// UpdateSandbox, re-reading and re-applying fn when another writer got in
// between (up to 8 times). fn sees a fresh copy each time and may return an
// error to abort. It returns the written record and revision.
func (s *Store) MutateSandbox(ctx context.Context, id string, fn func(*SandboxRecord) error) (SandboxRecord, int64, error) {
	for attempt := 0; attempt < 8; attempt++ {
		rec, rev, err := s.GetSandbox(ctx, id)
		if err != nil {
			return SandboxRecord{}, 0, err
		}
		if err := fn(&rec); err != nil {
			return SandboxRecord{}, 0, err
		}
		nrev, err := s.UpdateSandbox(ctx, id, rev, rec)
		if err == nil {
			return rec, nrev, nil
		}
		if !isConflict(err) {
			return SandboxRecord{}, 0, err
		}
	}
	return SandboxRecord{}, 0, fmt.Errorf("store: mutate sandbox %s: %w: too much contention", id, errdefs.ErrConflict)
}

// DeleteSandbox removes the record. With expectRevision > 0 the delete is
// conditional on the mod revision (errdefs.ErrConflict when it moved). errdefs.ErrNotFound
// when there is no record.
func (s *Store) DeleteSandbox(ctx context.Context, id string, expectRevision int64) error {
	k := sandboxKey(id)
	cmp := clientv3.Compare(clientv3.CreateRevision(k), ">", 0)
	if expectRevision > 0 {
		cmp = clientv3.Compare(clientv3.ModRevision(k), "=", expectRevision)
	}
	resp, err := s.cli.Txn(ctx).If(cmp).
		Then(clientv3.OpDelete(k)).
		Else(clientv3.OpGet(k, clientv3.WithCountOnly())).
		Commit()
	if err != nil {
		return wrapErr("delete sandbox", err)
	}
	if !resp.Succeeded {
		if len(resp.Responses) > 0 && resp.Responses[0].GetResponseRange().GetCount() == 0 {
			return fmt.Errorf("store: delete sandbox %s: %w", id, errdefs.ErrNotFound)
		}
		return fmt.Errorf("store: delete sandbox %s: %w: revision moved", id, errdefs.ErrConflict)
	}
	return nil
}

// SandboxEntry is a record with its mod revision.
type SandboxEntry struct {
	Record   SandboxRecord
	Revision int64
}

// ListSandboxes returns every sandbox record (tombstones included) sorted by
// id, with mod revisions. Undecodable entries are logged and skipped.
func (s *Store) ListSandboxes(ctx context.Context) ([]SandboxEntry, error) {
	resp, err := s.cli.Get(ctx, sandboxesPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, wrapErr("list sandboxes", err)
	}
	out := make([]SandboxEntry, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var rec SandboxRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			s.log.Warn("skipping undecodable sandbox record", "key", string(kv.Key), "err", err)
			continue
		}
		out = append(out, SandboxEntry{Record: rec, Revision: kv.ModRevision})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Record.ID < out[j].Record.ID })
	return out, nil
}

// SandboxEvent is one change delivered by WatchSandboxes.
type SandboxEvent struct {
	// Deleted is true when the record was removed; Record then holds only
	// the ID.
	Deleted  bool
	Record   SandboxRecord
	Revision int64
	// Synced marks the end of a full listing: every record that existed
	// at Revision was delivered before it (and Record is empty). A
	// consumer can then tell what the store no longer holds.
	Synced bool
}

// WatchSandboxes calls fn with an event for every existing record and a
// Synced event, then for every change, until ctx ends (it then returns
// ctx.Err()). After a broken
// watch it re-reads all records: fn sees the current record again for each,
// and a Deleted event for records that vanished in the gap. Consumers must be
// idempotent. fn runs on the watching goroutine.
func (s *Store) WatchSandboxes(ctx context.Context, fn func(SandboxEvent)) error {
	known := map[string]bool{}
	decode := func(kv []byte) (SandboxRecord, bool) {
		var rec SandboxRecord
		if err := json.Unmarshal(kv, &rec); err != nil {
			s.log.Warn("skipping undecodable sandbox record in watch", "err", err)
			return rec, false
		}
		return rec, true
	}
	return s.watchLoop(ctx, sandboxesPrefix, true, func(resp *clientv3.GetResponse) {
		seen := map[string]bool{}
		for _, kv := range resp.Kvs {
			id := strings.TrimPrefix(string(kv.Key), sandboxesPrefix)
			seen[id] = true
			if rec, ok := decode(kv.Value); ok {
				fn(SandboxEvent{Record: rec, Revision: kv.ModRevision})
			}
		}
		for id := range known {
			if !seen[id] {
				fn(SandboxEvent{Deleted: true, Record: SandboxRecord{ID: id}, Revision: resp.Header.Revision})
			}
		}
		known = seen
		fn(SandboxEvent{Synced: true, Revision: resp.Header.Revision})
	}, func(ev *clientv3.Event) {
		id := strings.TrimPrefix(string(ev.Kv.Key), sandboxesPrefix)
		if ev.Type == clientv3.EventTypeDelete {
			delete(known, id)
			fn(SandboxEvent{Deleted: true, Record: SandboxRecord{ID: id}, Revision: ev.Kv.ModRevision})
			return
		}
		known[id] = true
		if rec, ok := decode(ev.Kv.Value); ok {
			fn(SandboxEvent{Record: rec, Revision: ev.Kv.ModRevision})
		}
	})
}

func isNotFound(err error) bool { return errors.Is(err, errdefs.ErrNotFound) }
func isConflict(err error) bool { return errors.Is(err, errdefs.ErrConflict) }
