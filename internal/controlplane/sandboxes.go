package controlplane

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"
	"unicode/utf8"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/crashpoint"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/netpolicy"
	"github.com/spacesbx/space/internal/scheduler"
	"github.com/spacesbx/space/internal/store"
)

// Input limits.
const (
	maxMetadataEntries = 64
	maxMetadataKey     = 256
	maxMetadataValue   = 4096
	maxEnvVars         = 256
	maxEnvValue        = 64 << 10
	// installAttempts: a failed install is retried once on another worker
	// under a new generation.
	installAttempts = 2
)

var envNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// createParams is a validated create request.
type createParams struct {
	Template  string
	Spec      Template
	Timeout   time.Duration
	Metadata  map[string]string
	EnvVars   map[string]string
	Secure    bool
	AutoPause bool
	// AutoResume is lifecycle.autoResume (autoresume.go).
	AutoResume bool
	// RestoreSnapshot restores a snapshot's files at install (a create
	// from a snapshot).
	RestoreSnapshot string
	// PrivateTraffic: network.allowPublicTraffic was false; service ports
	// then need the traffic access token.
	PrivateTraffic bool
	// Network is the egress spec (never nil after validateCreate);
	// MaskRequestHost and HTTPSPorts are E2B's ingress options.
	Network         *netpolicy.Spec
	MaskRequestHost string
	HTTPSPorts      []int
	// Image is the OCI image of a template built fromImage (nil: the
	// template's own root file system).
	Image *spacev1.ImageSource
	// VolumeMounts are the team volumes the sandbox mounts (resolved by
	// resolveVolumeMounts).
	VolumeMounts []spacev1.VolumeMount
}

func (s *Server) validateCreate(c caller, req e2bapi.NewSandbox, v2 bool) (createParams, error) {
	p := createParams{Template: req.TemplateID, Metadata: req.Metadata, EnvVars: req.EnvVars}
	if req.TemplateID == "" {
		return p, fmt.Errorf("%w: templateID is required", errdefs.ErrInvalid)
	}
	spec, ok := s.cfg.Templates[req.TemplateID]
	if !ok {
		return p, fmt.Errorf("%w: template %q", errdefs.ErrNotFound, truncate(req.TemplateID, 64))
	}
	p.Spec = spec
	p.Timeout = s.cfg.DefaultTimeout
	if req.Timeout != nil {
		if *req.Timeout <= 0 {
			return p, fmt.Errorf("%w: timeout must be a positive number of seconds", errdefs.ErrInvalid)
		}
		p.Timeout = time.Duration(*req.Timeout) * time.Second
		if p.Timeout > s.cfg.MaxTimeout {
			return p, fmt.Errorf("%w: timeout exceeds the maximum of %d seconds", errdefs.ErrInvalid, int64(s.cfg.MaxTimeout/time.Second))
		}
	}
	if err := validateMetadata(req.Metadata); err != nil {
		return p, err
	}
	if len(req.EnvVars) > maxEnvVars {
		return p, fmt.Errorf("%w: at most %d envVars", errdefs.ErrInvalid, maxEnvVars)
	}
	for k, v := range req.EnvVars {
		if !envNameRE.MatchString(k) || len(k) > 256 {
			return p, fmt.Errorf("%w: envVars name %q is not a valid variable name", errdefs.ErrInvalid, truncate(k, 64))
		}
		if len(v) > maxEnvValue || !utf8.ValidString(v) || containsNUL(v) {
			return p, fmt.Errorf("%w: envVars %s: value must be UTF-8 without NUL, at most %d bytes", errdefs.ErrInvalid, k, maxEnvValue)
		}
	}
	if req.AutoResume != nil && req.AutoResume.Enabled {
		// E2B: a filesystem-only auto-pause cannot be resumed by traffic.
		if req.AutoPauseMemory != nil && !*req.AutoPauseMemory {
			return p, fmt.Errorf("%w: autoResume cannot be combined with autoPauseMemory false", errdefs.ErrInvalid)
		}
		p.AutoResume = true
	}
	p.Secure = v2 || (req.Secure != nil && *req.Secure)
	if err := s.parseCreateNetwork(c, req, &p); err != nil {
		return p, err
	}
	p.AutoPause = req.AutoPause != nil && *req.AutoPause
	return p, nil
}

func validateMetadata(m map[string]string) error {
	if len(m) > maxMetadataEntries {
		return fmt.Errorf("%w: at most %d metadata entries", errdefs.ErrInvalid, maxMetadataEntries)
	}
	for k, v := range m {
		if k == "" || len(k) > maxMetadataKey || len(v) > maxMetadataValue {
			return fmt.Errorf("%w: metadata keys must be 1..%d bytes and values at most %d", errdefs.ErrInvalid, maxMetadataKey, maxMetadataValue)
		}
		if !utf8.ValidString(k) || !utf8.ValidString(v) || containsNUL(k) || containsNUL(v) {
			return fmt.Errorf("%w: metadata must be UTF-8 without NUL", errdefs.ErrInvalid)
		}
	}
	return nil
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}

// CreateTimingMsg is the message of the debug record a create logs with
// its phases as durations: place (workers and their load read, pick),
// record (the creating record written), install (the worker's answer),
// commit (the running record written), and schedule (the request's
// arrival to the placement decision of the first attempt, also the
// space_api_schedule_seconds histogram). make bench aggregates them.
const CreateTimingMsg = "create timing"

// createSandbox places, records and installs a new sandbox. It runs to
// completion even if ctx is cancelled (the client went away), so the
// record never stays half-made.
func (s *Server) createSandbox(ctx context.Context, c caller, p createParams) (store.SandboxRecord, error) {
	arrived := arrival(ctx)
	ctx = context.WithoutCancel(ctx)
	now := s.now().UTC()
	rec := store.SandboxRecord{
		ID: newSandboxID(), TeamID: c.TeamID, KeyID: c.KeyID, TemplateID: p.Template,
		Metadata: p.Metadata, EnvVars: p.EnvVars, State: store.StateCreating,
		CPUCount: p.Spec.CPUCount, MemoryMB: p.Spec.MemoryMB, DiskSizeMB: p.Spec.DiskSizeMB,
		AutoPause: p.AutoPause, CreatedAt: now, EndAt: now.Add(p.Timeout), Creator: s.instance,
		AutoResume: p.AutoResume, ResumeTimeout: p.Timeout,
	}
	if p.Secure {
		rec.AccessToken = randHex(32)
	}
	if p.PrivateTraffic {
		rec.TrafficAccessToken = randHex(32)
	}
	rec.Network, rec.MaskRequestHost, rec.HTTPSPorts = p.Network, p.MaskRequestHost, p.HTTPSPorts
	rec.Image = p.Image
	rec.VolumeMounts = p.VolumeMounts
	if err := newEgressCA(&rec); err != nil {
		return rec, err
	}
	nw, err := s.installNetwork(ctx, rec)
	if err != nil {
		return rec, err
	}
	var (
		rev      int64
		tried    []string
		lastErr  error
		schedule time.Duration
	)
	for attempt := 0; attempt < installAttempts; attempt++ {
		t0 := time.Now()
		w, tPlace, err := s.placeCreate(ctx, &rec, &rev, p.Spec.Substrate, tried)
		if err != nil {
			// No room after a failed install: the install's error says more.
			if lastErr == nil || !errors.Is(err, scheduler.ErrNoCapacity) {
				lastErr = err
			}
			break
		}
		tried = append(tried, w.ID)
		if attempt == 0 {
			schedule = tPlace.Sub(arrived)
			s.obs.schedule.Observe(schedule.Seconds())
		}
		if attempt == 0 {
			// The record names the volumes now: a delete from here on
			// sees it (volumes.go).
			if verr := s.checkVolumesLive(ctx, rec); verr != nil {
				lastErr = verr
				break
			}
		}
		crashpoint.Hit(crashpoint.CreateRecorded)
		log := s.log.With("sandbox", rec.ID, "generation", rec.Route.Generation, "worker", w.ID)
		tRecord := time.Now()
		resp, err := s.node.install(ctx, w.NodeURL, spacev1.InstallRequest{
			Route: rec.Route, Template: rec.TemplateID, EnvVars: rec.EnvVars,
			Limits: limitsOf(rec), RestoreSnapshot: p.RestoreSnapshot, Network: nw, Image: rec.Image, Volumes: rec.VolumeMounts,
		})
		if err != nil {
			log.Warn("install failed", "err", err)
			lastErr = err
			if terr := s.node.teardown(ctx, w.NodeURL, rec.Route); terr != nil {
				log.Warn("teardown after failed install failed", "err", terr)
			}
			continue
		}
		crashpoint.Hit(crashpoint.CreateInstalled)
		tInstall := time.Now()
		started := s.now().UTC()
		rec.State = store.StateRunning
		rec.StartedAt = started
		rec.EndAt = started.Add(p.Timeout)
		rec.EnvdVersion = resp.EnvdVersion
		if rec.EnvdVersion == "" {
			rec.EnvdVersion = s.cfg.DefaultEnvdVersion
		}
		rec.Executions = append(rec.Executions, spacev1.Execution{Route: rec.Route, State: "running", StartedAt: started})
		if _, err := s.st.UpdateSandbox(ctx, rec.ID, rev, rec); err != nil {
			// Killed while installing: undo the install.
			log.Warn("sandbox changed during install; tearing down", "err", err)
			if terr := s.node.teardown(ctx, w.NodeURL, rec.Route); terr != nil {
				log.Warn("teardown failed", "err", terr)
			}
			return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s was removed while starting", errdefs.ErrConflict, rec.ID)
		}
		log.Debug(CreateTimingMsg, "place", tPlace.Sub(t0), "record", tRecord.Sub(tPlace),
			"install", tInstall.Sub(tRecord), "commit", time.Since(tInstall), "schedule", schedule)
		log.Info("sandbox created", "template", rec.TemplateID, "end_at", rec.EndAt)
		return rec, nil
	}
	if rev != 0 {
		rec.State = store.StateFailed
		rec.EndedAt = s.now().UTC()
		rec.Reason = "install failed: " + truncate(errString(lastErr), 200)
		if _, err := s.st.UpdateSandbox(ctx, rec.ID, rev, rec); err != nil {
			s.log.Warn("marking sandbox failed", "sandbox", rec.ID, "err", err)
		}
	}
	if lastErr == nil {
		lastErr = fmt.Errorf("%w: sandbox could not be placed", errdefs.ErrUnavailable)
	}
	return store.SandboxRecord{}, fmt.Errorf("create sandbox: %w", lastErr)
}

// placeCreate picks a worker for a create and writes the record (rev 0:
// creates it; else moves it to a new generation there), guarded by the
// worker's placements as read with its load: when another placement on
// the picked worker committed meanwhile it reads and picks again. It
// returns the worker and when the pick was made.
func (s *Server) placeCreate(ctx context.Context, rec *store.SandboxRecord, rev *int64, substrate string, tried []string) (spacev1.Worker, time.Time, error) {
	for try := range maxPlacementRetries {
		// The watched view first; after a guard refused it, the store's
		// own view (the watch may not have delivered the placement that
		// moved the guard yet).
		w, guard, err := s.pick(ctx, substrate, tried, try > 0)
		if err != nil {
			return spacev1.Worker{}, time.Time{}, err
		}
		tPlace := time.Now()
		next := *rec
		next.Generation++
		next.Route = s.newRoute(next.ID, next.Generation, w.ID, substrate)
		next.NodeURL = w.NodeURL
		var nrev int64
		if *rev == 0 {
			nrev, err = s.st.CreateSandboxPlaced(ctx, next, guard)
		} else {
			nrev, err = s.st.UpdateSandboxPlaced(ctx, next.ID, *rev, next, guard)
		}
		if errors.Is(err, store.ErrPlacementMoved) {
			s.obs.placementRetries.Inc()
			continue
		}
		if err != nil {
			return spacev1.Worker{}, time.Time{}, err
		}
		*rec, *rev = next, nrev
		return w, tPlace, nil
	}
	return spacev1.Worker{}, time.Time{}, fmt.Errorf("%w: placements on the workers kept moving; retry", errdefs.ErrUnavailable)
}

// visible reports whether an E2B route shows the record: an owner's,
// started and not a tombstone.
func visible(rec store.SandboxRecord, team string) bool {
	return rec.TeamID == team && (rec.State == store.StateRunning || rec.State == store.StatePaused || rec.State.Transitional())
}

func (s *Server) getSandbox(ctx context.Context, c caller, id string) (store.SandboxRecord, error) {
	rec, _, err := s.st.GetSandbox(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) || (err == nil && !visible(rec, c.TeamID)) {
		return store.SandboxRecord{}, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
	}
	if err != nil {
		return store.SandboxRecord{}, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	return rec, nil
}

// killSandbox marks the sandbox killed (so no capability is issued for it
// from now on), then tears its execution down on the worker. check, when
// non-nil, must accept the current record (the reaper re-checks expiry).
// team "" skips the ownership check.
func (s *Server) killSandbox(ctx context.Context, id, team, reason string, check func(store.SandboxRecord) error) error {
	now := s.now().UTC()
	rec, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		if (team != "" && r.TeamID != team) || r.State.Terminal() {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		if check != nil {
			if err := check(*r); err != nil {
				return err
			}
		}
		r.State = store.StateKilled
		r.EndedAt = now
		r.Reason = reason
		for i := range r.Executions {
			if r.Executions[i].EndedAt == nil {
				r.Executions[i].State = "killed"
				r.Executions[i].EndedAt = &now
			}
		}
		// A kill ends any lifecycle operation: it finds the record gone
		// from its hands and undoes its install.
		r.Op = nil
		return nil
	})
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		return err
	}
	crashpoint.Hit(crashpoint.KillMarked)
	log := s.log.With("sandbox", id, "generation", rec.Route.Generation, "worker", rec.Route.WorkerID)
	log.Info("sandbox killed", "reason", reason)
	if rec.Route.WorkerID != "" {
		if err := s.node.teardown(ctx, s.nodeURL(ctx, rec), rec.Route); err != nil {
			// The record is killed: no new capability names this
			// execution, and workers learn of it through the record watch.
			log.Warn("teardown failed; execution left to worker reconciliation", "err", err)
		}
	}
	s.teardownPending(ctx, rec)
	return nil
}

func (s *Server) setTimeout(ctx context.Context, c caller, id string, secs int32) error {
	if secs < 0 || time.Duration(secs)*time.Second > s.cfg.MaxTimeout {
		return fmt.Errorf("%w: timeout must be 0..%d seconds", errdefs.ErrInvalid, int64(s.cfg.MaxTimeout/time.Second))
	}
	end := s.now().UTC().Add(time.Duration(secs) * time.Second)
	_, _, err := s.st.MutateSandbox(ctx, id, func(r *store.SandboxRecord) error {
		if !visible(*r, c.TeamID) {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		r.EndAt = end
		return nil
	})
	if errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
	}
	return err
}
