package controlplane

import (
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/store"
)

// Lifecycle events, webhooks and sandbox logs (E2B's events API,
// /events/webhooks, /v2/sandboxes/{id}/logs). The events are recorded by
// internal/events from the committed sandbox records, so the lifecycle
// handlers need no hook of their own: a committed change is an event.

// eventRoutes registers the events, webhooks and logs routes.
func (s *Server) eventRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /events/sandboxes", s.withKey(s.handleTeamEvents))
	mux.HandleFunc("GET /events/sandboxes/{id}", s.withKey(s.handleSandboxEvents))
	mux.HandleFunc("POST /events/webhooks", s.withKey(s.handleCreateWebhook))
	mux.HandleFunc("GET /events/webhooks", s.withKey(s.handleListWebhooks))
	mux.HandleFunc("GET /events/webhooks/{id}", s.withKey(s.handleGetWebhook))
	mux.HandleFunc("PATCH /events/webhooks/{id}", s.withKey(s.handleUpdateWebhook))
	mux.HandleFunc("DELETE /events/webhooks/{id}", s.withKey(s.handleDeleteWebhook))
	mux.HandleFunc("GET /v2/sandboxes/{id}/logs", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleLogs(w, r, c, true) }))
	mux.HandleFunc("GET /sandboxes/{id}/logs", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleLogs(w, r, c, false) }))
}

// startEvents starts the events service of this control plane (every
// instance campaigns; the elected one records and delivers).
func (s *Server) startEvents() error {
	cfg := s.cfg.Events
	cfg.Instance = s.instance
	cfg.AllowPrivate = s.cfg.WebhookAllowPrivate
	cfg.Logger = s.log
	cfg.Clock = s.now
	ev, err := events.New(cfg, s.st)
	if err != nil {
		return fmt.Errorf("controlplane: %w", err)
	}
	s.events = ev
	ev.Start()
	return nil
}

// Bounds of the events API (E2B's: limit 1..100, default 10).
const (
	defaultEventLimit = 10
	maxEventLimit     = 100
	maxEventOffset    = 10000
)

// eventQuery parses offset, limit, orderAsc and types (repeatable).
func eventQuery(q url.Values, team, sandbox string) (store.EventQuery, error) {
	eq := store.EventQuery{TeamID: team, SandboxID: sandbox, Limit: defaultEventLimit}
	for name, dst := range map[string]*int{"offset": &eq.Offset, "limit": &eq.Limit} {
		v := q.Get(name)
		if v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return eq, fmt.Errorf("%w: %s must be an integer", errdefs.ErrInvalid, name)
		}
		*dst = n
	}
	switch {
	case eq.Offset < 0 || eq.Offset > maxEventOffset:
		return eq, fmt.Errorf("%w: offset must be 0..%d", errdefs.ErrInvalid, maxEventOffset)
	case eq.Limit < 1 || eq.Limit > maxEventLimit:
		return eq, fmt.Errorf("%w: limit must be 1..%d", errdefs.ErrInvalid, maxEventLimit)
	}
	if ts := q["types"]; len(ts) > 0 {
		if len(ts) > len(e2bapi.EventTypes) {
			return eq, fmt.Errorf("%w: at most %d types", errdefs.ErrInvalid, len(e2bapi.EventTypes))
		}
		for _, t := range ts {
			if !e2bapi.KnownEventType(t) {
				return eq, fmt.Errorf("%w: unknown event type %q", errdefs.ErrInvalid, truncate(t, 64))
			}
		}
		eq.Types = ts
	}
	if v := q.Get("orderAsc"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return eq, fmt.Errorf("%w: orderAsc must be true or false", errdefs.ErrInvalid)
		}
		eq.Asc = b
	}
	return eq, nil
}

func (s *Server) handleTeamEvents(w http.ResponseWriter, r *http.Request, c caller) {
	s.listEvents(w, r, c, "")
}

func (s *Server) handleSandboxEvents(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	s.listEvents(w, r, c, id)
}

// listEvents answers the caller's team's events (of one sandbox when
// sandbox is set: 404 when the team has neither its record nor an event
// of it, as for any other team's sandbox).
func (s *Server) listEvents(w http.ResponseWriter, r *http.Request, c caller, sandbox string) {
	q, err := eventQuery(r.URL.Query(), c.TeamID, sandbox)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if sandbox != "" {
		if _, _, err := s.teamSandbox(r.Context(), c, sandbox); err != nil {
			s.writeError(w, r, err)
			return
		}
	}
	evs, err := s.st.ListEvents(r.Context(), q)
	if err != nil {
		s.writeError(w, r, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err))
		return
	}
	out := make([]e2bapi.SandboxEvent, 0, len(evs))
	for _, e := range evs {
		out = append(out, e.Event)
	}
	writeJSON(w, http.StatusOK, out)
}
