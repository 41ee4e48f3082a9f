package controlplane

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/events"
	"github.com/spacesbx/space/internal/store"
)

// Webhooks (E2B's /events/webhooks). The signature secret is stored for
// signing and never returned or logged.

func (s *Server) handleCreateWebhook(w http.ResponseWriter, r *http.Request, c caller) {
	var body e2bapi.NewWebhook
	if err := decodeJSON(w, r, &body, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	rec := store.WebhookRecord{ID: events.NewID(), TeamID: c.TeamID, Name: body.Name, URL: body.URL, Enabled: true,
		Events: body.Events, Secret: body.SignatureSecret, CreatedAt: s.now().UTC()}
	if body.Enabled != nil {
		rec.Enabled = *body.Enabled
	}
	if err := s.validateWebhook(rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := s.st.CreateWebhook(r.Context(), rec, s.events.Config().MaxWebhooksPerTeam); err != nil {
		s.writeError(w, r, storeErr(err))
		return
	}
	s.log.Info("webhook registered", "webhook", rec)
	writeJSON(w, http.StatusCreated, s.webhookBody(r, rec))
}

func (s *Server) validateWebhook(rec store.WebhookRecord) error {
	return events.ValidateWebhook(events.Webhook{Name: rec.Name, URL: rec.URL, Events: rec.Events, Secret: rec.Secret, Enabled: rec.Enabled},
		s.cfg.WebhookAllowPrivate)
}

func (s *Server) handleListWebhooks(w http.ResponseWriter, r *http.Request, c caller) {
	hooks, err := s.st.ListWebhooks(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, storeErr(err))
		return
	}
	out := make([]e2bapi.Webhook, 0, len(hooks))
	for _, h := range hooks {
		out = append(out, s.webhookBody(r, h))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) handleGetWebhook(w http.ResponseWriter, r *http.Request, c caller) {
	h, _, err := s.st.GetWebhook(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, storeErr(err))
		return
	}
	writeJSON(w, http.StatusOK, s.webhookBody(r, h))
}

func (s *Server) handleUpdateWebhook(w http.ResponseWriter, r *http.Request, c caller) {
	var body e2bapi.WebhookUpdate
	if err := decodeJSON(w, r, &body, true); err != nil {
		s.writeError(w, r, err)
		return
	}
	h, err := s.st.UpdateWebhook(r.Context(), c.TeamID, r.PathValue("id"), func(h *store.WebhookRecord) error {
		if body.Name != nil {
			h.Name = *body.Name
		}
		if body.URL != nil {
			h.URL = *body.URL
		}
		if body.Enabled != nil {
			h.Enabled = *body.Enabled
		}
		if body.Events != nil {
			h.Events = *body.Events
		}
		if body.SignatureSecret != nil {
			h.Secret = *body.SignatureSecret
		}
		return s.validateWebhook(*h)
	})
	if err != nil {
		s.writeError(w, r, storeErr(err))
		return
	}
	s.events.Kick()
	writeJSON(w, http.StatusOK, s.webhookBody(r, h))
}

func (s *Server) handleDeleteWebhook(w http.ResponseWriter, r *http.Request, c caller) {
	if err := s.st.DeleteWebhook(r.Context(), c.TeamID, r.PathValue("id")); err != nil {
		s.writeError(w, r, storeErr(err))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// webhookBody is h as the API shows it: without its secret, with its
// delivery state (best effort: a failed read shows none).
func (s *Server) webhookBody(r *http.Request, h store.WebhookRecord) e2bapi.Webhook {
	out := e2bapi.Webhook{ID: h.ID, TeamID: h.TeamID, Name: h.Name, CreatedAt: h.CreatedAt, Enabled: h.Enabled, URL: h.URL,
		Events: append([]string{}, h.Events...)}
	st, pending, failed, err := s.st.WebhookDeliveries(r.Context(), h.ID)
	if err != nil {
		return out
	}
	ds := e2bapi.WebhookDeliveryState{Pending: pending, Delivered: st.Delivered, Failed: st.Failed, LastStatus: st.LastStatus, LastError: st.LastError}
	if !st.LastAt.IsZero() {
		t := st.LastAt
		ds.LastAt = &t
	}
	for _, f := range failed {
		ds.RecentFailures = append(ds.RecentFailures, e2bapi.FailedDelivery{DeliveryID: f.ID, EventID: f.EventID, EventType: f.EventType,
			Attempts: f.Attempts, LastError: f.LastError, FailedAt: f.FailedAt})
	}
	out.Deliveries = ds
	return out
}

// storeErr keeps the classes the API answers with (not found, invalid,
// conflict) and makes any other store failure a 503.
func storeErr(err error) error {
	for _, class := range []error{errdefs.ErrNotFound, errdefs.ErrInvalid, errdefs.ErrConflict} {
		if errors.Is(err, class) {
			return err
		}
	}
	return fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
}
