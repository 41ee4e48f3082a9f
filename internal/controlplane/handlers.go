package controlplane

import (
	"context"
	"fmt"
	"net/http"
	"strconv"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

func (s *Server) domain() *string { d := s.cfg.Domain; return &d }

func (s *Server) handleCreate(w http.ResponseWriter, r *http.Request, c caller, v2 bool) {
	var req e2bapi.NewSandbox
	// Unknown fields are ignored, as E2B does: newer SDKs add fields, and
	// every field we do not implement only asks for more than we give.
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	built, err := s.resolveBuiltTemplate(r.Context(), c, &req)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	snap, err := s.resolveSnapshotTemplate(r.Context(), c, &req)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	p, err := s.validateCreate(c, req, v2)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	p.RestoreSnapshot = snap
	if built != nil {
		p.Image = built.build.Image
	}
	if built == nil || built.build.StartCmd == "" {
		// A platform template's server, also under a team template built
		// from it without a start command of its own (as E2B's templates
		// built from code-interpreter-v1 keep its server).
		if pt := platformStart(p.Template, p.Spec); pt != nil {
			built = pt
		}
	}
	if p.VolumeMounts, err = s.resolveVolumeMounts(r.Context(), c.TeamID, req.VolumeMounts); err != nil {
		s.writeError(w, r, err)
		return
	}
	var rec store.SandboxRecord
	if p.Spec.WarmSnapshot && snap == "" {
		rec, err = s.createWarm(r.Context(), c, p)
	} else {
		rec, err = s.createSandbox(r.Context(), c, p)
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.startTemplate(r.Context(), built, rec); err != nil {
		// The sandbox is of no use without its server: gone, and said why.
		_ = s.killSandbox(context.WithoutCancel(r.Context()), rec.ID, c.TeamID, "start command failed", func(store.SandboxRecord) error { return nil })
		s.writeError(w, r, fmt.Errorf("%w: template start command: %v", errdefs.ErrUnavailable, err))
		return
	}
	writeJSON(w, http.StatusCreated, s.created(rec))
}

// clientID fills E2B's deprecated clientID field.
const clientID = "space"

func (s *Server) detail(rec store.SandboxRecord) e2bapi.SandboxDetail {
	onTimeout := "kill"
	if rec.AutoPause {
		onTimeout = "pause"
	}
	d := e2bapi.SandboxDetail{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, Alias: rec.Alias, ClientID: clientID,
		CPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB, DiskSizeMB: rec.DiskSizeMB, Domain: s.domain(),
		StartedAt: rec.StartedAt, EndAt: rec.EndAt, EnvdVersion: rec.EnvdVersion,
		EnvdAccessToken: rec.AccessToken, Metadata: rec.Metadata, State: e2bState(rec),
		Lifecycle:    &e2bapi.SandboxLifecycle{OnTimeout: onTimeout, AutoResume: rec.AutoResume},
		VolumeMounts: volumeMountsOf(rec),
	}
	d.AllowInternetAccess, d.Network = networkDetail(rec)
	return d
}

func listed(rec store.SandboxRecord) e2bapi.ListedSandbox {
	return e2bapi.ListedSandbox{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, Alias: rec.Alias, ClientID: clientID,
		CPUCount: rec.CPUCount, MemoryMB: rec.MemoryMB, DiskSizeMB: rec.DiskSizeMB,
		StartedAt: rec.StartedAt, EndAt: rec.EndAt, EnvdVersion: rec.EnvdVersion,
		Metadata: rec.Metadata, State: e2bState(rec), VolumeMounts: volumeMountsOf(rec),
	}
}

func (s *Server) handleGet(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, err := s.getSandbox(r.Context(), c, id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s.detail(rec))
}

func (s *Server) handleList(w http.ResponseWriter, r *http.Request, c caller, v2 bool) {
	lq, err := parseListQuery(r.URL.Query(), v2)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	entries, err := s.st.ListSandboxes(r.Context())
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	page, next, running := filterSandboxes(entries, c.TeamID, lq)
	out := make([]e2bapi.ListedSandbox, 0, len(page))
	for _, rec := range page {
		out = append(out, listed(rec))
	}
	if next != "" {
		w.Header().Set(e2bapi.HeaderNextToken, next)
	}
	if v2 && lq.States[e2bapi.StateRunning] {
		w.Header().Set(e2bapi.HeaderTotalRunning, strconv.Itoa(running))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) handleListV1(w http.ResponseWriter, r *http.Request, c caller) {
	s.handleList(w, r, c, false)
}
func (s *Server) handleListV2(w http.ResponseWriter, r *http.Request, c caller) {
	s.handleList(w, r, c, true)
}

func (s *Server) handleKill(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// A kill runs to completion even if the client goes away.
	if err := s.killSandbox(context.WithoutCancel(r.Context()), id, c.TeamID, "killed by "+c.KeyID, func(rec store.SandboxRecord) error {
		if !visible(rec, c.TeamID) {
			return fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		return nil
	}); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) handleTimeout(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var req struct {
		Timeout *int32 `json:"timeout"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Timeout == nil {
		s.writeError(w, r, fmt.Errorf("%w: timeout is required", errdefs.ErrInvalid))
		return
	}
	if err := s.setTimeout(r.Context(), c, id, *req.Timeout); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// e2bState is the state E2B clients see: a record in a transitional state
// shows the stable state its operation started from.
func e2bState(rec store.SandboxRecord) string {
	if rec.Op != nil {
		return string(rec.Op.From)
	}
	return string(rec.State)
}

// sandboxBody is the E2B Sandbox answer for an existing sandbox.
func (s *Server) sandboxBody(rec store.SandboxRecord) e2bapi.Sandbox {
	var traffic *string
	if rec.TrafficAccessToken != "" {
		traffic = &rec.TrafficAccessToken
	}
	return e2bapi.Sandbox{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, Alias: rec.Alias, ClientID: clientID,
		EnvdVersion: rec.EnvdVersion, EnvdAccessToken: rec.AccessToken, Domain: s.domain(),
		TrafficAccessToken: traffic,
	}
}

// created is the E2B create response for rec.
func (s *Server) created(rec store.SandboxRecord) *e2bapi.Sandbox {
	var traffic *string
	if rec.TrafficAccessToken != "" {
		traffic = &rec.TrafficAccessToken
	}
	return &e2bapi.Sandbox{
		SandboxID: rec.ID, TemplateID: rec.TemplateID, ClientID: clientID,
		EnvdVersion: rec.EnvdVersion, EnvdAccessToken: rec.AccessToken, Domain: s.domain(),
		TrafficAccessToken: traffic,
	}
}
