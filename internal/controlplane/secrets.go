package controlplane

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Secret limits (E2B's documented metadata bounds; the value bound is ours:
// secrets are API keys and tokens, not files).
const (
	maxSecretName          = 128
	maxSecretValue         = 16 << 10
	maxSecretMetaEntries   = 32
	maxSecretMetaKey       = 128
	maxSecretMetaValue     = 1024
	maxSecretMetaTotal     = 8192
	maxSecretsPerTeam      = 1000
	defaultSecretPageLimit = 100
)

// secretNameRE: names are interpolated into ${e2b.secrets.<name>}, so no
// braces or control characters (the SDK refuses them too); we take the
// conservative DNS-label-like set E2B documents, lower-cased.
var secretNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]*$`)

// secretInfo is E2B's Secret schema: metadata only, never the value.
type secretInfo struct {
	SecretID       string            `json:"secretID"`
	Name           string            `json:"name"`
	CurrentVersion int64             `json:"currentVersion"`
	Metadata       map[string]string `json:"metadata"`
	CreatedAt      time.Time         `json:"createdAt"`
	UpdatedAt      time.Time         `json:"updatedAt"`
}

func toSecretInfo(r store.SecretRecord) secretInfo {
	md := r.Metadata
	if md == nil {
		md = map[string]string{}
	}
	return secretInfo{SecretID: r.ID, Name: r.Name, CurrentVersion: r.CurrentVersion, Metadata: md, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}
}

func validateSecretValue(v string) error {
	if v == "" || len(v) > maxSecretValue || !utf8.ValidString(v) || strings.ContainsAny(v, "\x00\r\n") {
		return fmt.Errorf("%w: secret value must be 1..%d bytes of UTF-8 without NUL, CR or LF (it is sent in HTTP headers)", errdefs.ErrInvalid, maxSecretValue)
	}
	return nil
}

func validateSecretMetadata(m map[string]string) error {
	if len(m) > maxSecretMetaEntries {
		return fmt.Errorf("%w: at most %d metadata entries", errdefs.ErrInvalid, maxSecretMetaEntries)
	}
	total := 0
	for k, v := range m {
		if k == "" || len(k) > maxSecretMetaKey || len(v) > maxSecretMetaValue || !utf8.ValidString(k) || !utf8.ValidString(v) || containsNUL(k) || containsNUL(v) {
			return fmt.Errorf("%w: metadata keys must be 1..%d bytes, values at most %d, UTF-8 without NUL", errdefs.ErrInvalid, maxSecretMetaKey, maxSecretMetaValue)
		}
		total += len(k) + len(v)
	}
	if total > maxSecretMetaTotal {
		return fmt.Errorf("%w: a secret's metadata is at most %d bytes", errdefs.ErrInvalid, maxSecretMetaTotal)
	}
	return nil
}

// handleCreateSecret is E2B's POST /secrets (Secret.create).
func (s *Server) handleCreateSecret(w http.ResponseWriter, r *http.Request, c caller) {
	var req struct {
		Name     string            `json:"name"`
		Value    string            `json:"value"`
		Metadata map[string]string `json:"metadata"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	name := strings.ToLower(req.Name)
	if len(name) > maxSecretName || !secretNameRE.MatchString(name) || strings.HasPrefix(name, "sec_") {
		s.writeError(w, r, fmt.Errorf("%w: secret name must be 1..%d characters of a-z, 0-9, '_', '.', '-' (lower-cased) and not start with the reserved sec_", errdefs.ErrInvalid, maxSecretName))
		return
	}
	if err := validateSecretValue(req.Value); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validateSecretMetadata(req.Metadata); err != nil {
		s.writeError(w, r, err)
		return
	}
	existing, err := s.st.ListSecrets(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if len(existing) >= maxSecretsPerTeam {
		s.writeError(w, r, fmt.Errorf("%w: a team has at most %d secrets", errdefs.ErrInvalid, maxSecretsPerTeam))
		return
	}
	now := s.now().UTC()
	rec := store.SecretRecord{ID: "sec_" + randHex(12), TeamID: c.TeamID, Name: name, Value: req.Value,
		CurrentVersion: 1, Metadata: req.Metadata, CreatedAt: now, UpdatedAt: now}
	if err := s.st.CreateSecret(r.Context(), rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("secret created", "team", c.TeamID, "secret", rec.ID, "name", rec.Name)
	writeJSON(w, http.StatusCreated, toSecretInfo(rec))
}

// handleListSecrets is E2B's GET /secrets (paginated by name).
func (s *Server) handleListSecrets(w http.ResponseWriter, r *http.Request, c caller) {
	limit := defaultSecretPageLimit
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			s.writeError(w, r, fmt.Errorf("%w: limit must be 1..1000", errdefs.ErrInvalid))
			return
		}
		limit = n
	}
	after := r.URL.Query().Get("nextToken")
	all, err := s.st.ListSecrets(r.Context(), c.TeamID)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := []secretInfo{}
	for _, rec := range all {
		if after != "" && rec.Name <= after {
			continue
		}
		if len(out) == limit {
			w.Header().Set("X-Next-Token", out[len(out)-1].Name)
			break
		}
		out = append(out, toSecretInfo(rec))
	}
	writeJSON(w, http.StatusOK, out)
}

// handleGetSecret is E2B's GET /secrets/{secretID} (id or name).
func (s *Server) handleGetSecret(w http.ResponseWriter, r *http.Request, c caller) {
	rec, _, err := s.st.GetSecret(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, toSecretInfo(rec))
}

// handleUpdateSecret is E2B's POST /secrets/{secretID}: a new version.
// The team's running sandboxes whose rules name it get their policy again
// with the new value before this answers (best effort: one that cannot be
// reached gets it at its next network update, resume or move).
func (s *Server) handleUpdateSecret(w http.ResponseWriter, r *http.Request, c caller) {
	var req struct {
		Value    string            `json:"value"`
		Metadata map[string]string `json:"metadata"`
	}
	if err := decodeJSON(w, r, &req, false); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validateSecretValue(req.Value); err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := validateSecretMetadata(req.Metadata); err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, rev, err := s.st.GetSecret(r.Context(), c.TeamID, r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec.Value = req.Value
	rec.CurrentVersion++
	if req.Metadata != nil {
		rec.Metadata = req.Metadata
	}
	rec.UpdatedAt = s.now().UTC()
	if err := s.st.UpdateSecret(r.Context(), rev, rec); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("secret updated", "team", c.TeamID, "secret", rec.ID, "version", rec.CurrentVersion)
	s.repushSecret(r.Context(), c.TeamID, rec.Name)
	writeJSON(w, http.StatusOK, toSecretInfo(rec))
}

// handleDeleteSecret is E2B's DELETE /secrets/{secretID}.
func (s *Server) handleDeleteSecret(w http.ResponseWriter, r *http.Request, c caller) {
	if err := s.st.DeleteSecret(r.Context(), c.TeamID, r.PathValue("id")); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.log.Info("secret deleted", "team", c.TeamID, "secret", r.PathValue("id"))
	w.WriteHeader(http.StatusNoContent)
}

// repushSecret sends the policy again, with the secret's new value, to
// the team's running sandboxes whose rules name it.
func (s *Server) repushSecret(ctx context.Context, team, name string) {
	entries, err := s.st.ListSandboxes(ctx)
	if err != nil {
		s.log.Warn("secret update: listing sandboxes", "err", err)
		return
	}
	for _, e := range entries {
		rec := e.Record
		if rec.TeamID != team || rec.State != store.StateRunning || rec.Network == nil || !slices.Contains(rec.Network.SecretRefs(), name) {
			continue
		}
		nw, err := s.installNetwork(ctx, rec)
		if err == nil {
			err = s.node.setNetwork(ctx, rec.NodeURL, spacev1.NetworkRequest{Route: rec.Route, Network: *nw})
		}
		if err != nil {
			s.log.Warn("secret update not in force on a running sandbox yet", "sandbox", rec.ID, "generation", rec.Route.Generation, "err", err)
		}
	}
}
