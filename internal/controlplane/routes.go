package controlplane

import (
	"fmt"
	"net/http"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
)

// routes is the API's one route table. E2B routes authenticate a team's API
// key (withKey); the /space/v1 reads authenticate in their handler, since
// the edge's service key may use them too.
func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", s.handleHealth)

	// E2B: sandboxes (handlers.go, sandboxes.go, metrics.go).
	mux.HandleFunc("POST /sandboxes", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleCreate(w, r, c, false) }))
	mux.HandleFunc("POST /v2/sandboxes", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleCreate(w, r, c, true) }))
	mux.HandleFunc("GET /sandboxes", s.withKey(s.handleListV1))
	mux.HandleFunc("GET /v2/sandboxes", s.withKey(s.handleListV2))
	mux.HandleFunc("GET /sandboxes/{id}", s.withKey(s.handleGet))
	mux.HandleFunc("GET /sandboxes/{id}/metrics", s.withKey(s.handleMetrics))
	mux.HandleFunc("DELETE /sandboxes/{id}", s.withKey(s.handleKill))
	mux.HandleFunc("POST /sandboxes/{id}/timeout", s.withKey(s.handleTimeout))
	mux.HandleFunc("PUT /sandboxes/{id}/network", s.withKey(s.handleUpdateNetwork))

	// E2B: metrics over time, team metrics, refreshes (metricsrange.go).
	s.apiMetricsRoutes(mux)

	// E2B: lifecycle (pause.go, resume.go, snapshot.go, fork.go).
	mux.HandleFunc("POST /sandboxes/{id}/pause", s.withKey(s.handlePause))
	mux.HandleFunc("POST /sandboxes/{id}/resume", s.withKey(s.handleResume))
	mux.HandleFunc("POST /sandboxes/{id}/connect", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleConnect(w, r, c, false) }))
	mux.HandleFunc("POST /v2/sandboxes/{id}/connect", s.withKey(func(w http.ResponseWriter, r *http.Request, c caller) { s.handleConnect(w, r, c, true) }))
	mux.HandleFunc("POST /sandboxes/{id}/snapshots", s.withKey(s.handleCreateSnapshot))
	mux.HandleFunc("GET /snapshots", s.withKey(s.handleListSnapshots))
	mux.HandleFunc("DELETE /templates/{id}", s.withKey(s.handleDeleteTemplate))
	mux.HandleFunc("POST /sandboxes/{id}/fork", s.withKey(s.handleFork))

	// E2B: template builds (templates.go).
	mux.HandleFunc("POST /v3/templates", s.withKey(s.handleRequestBuild))
	mux.HandleFunc("GET /templates/{id}/files/{hash}", s.withKey(s.handleFileUploadLink))
	mux.HandleFunc("PUT /template-files/{team}/{hash}", s.handleFileUpload) // authorized by the link's signature
	mux.HandleFunc("POST /v2/templates/{id}/builds/{buildID}", s.withKey(s.handleStartBuild))
	mux.HandleFunc("GET /templates/{id}/builds/{buildID}/status", s.withKey(s.handleBuildStatus))
	// /templates/aliases/{alias} and /templates/{id}/tags overlap for the
	// mux ("/templates/aliases/tags"): one pattern, told apart here.
	mux.HandleFunc("GET /templates/{id}/{sub}", s.withKey(s.handleTemplateSub))
	mux.HandleFunc("GET /templates", s.withKey(s.handleListTemplates))
	mux.HandleFunc("GET /templates/{id}", s.withKey(s.handleGetTemplate))
	mux.HandleFunc("POST /templates/tags", s.withKey(s.handleAssignTags))
	mux.HandleFunc("DELETE /templates/tags", s.withKey(s.handleDeleteTags))

	// E2B: secrets (secrets.go).
	mux.HandleFunc("POST /secrets", s.withKey(s.handleCreateSecret))
	mux.HandleFunc("GET /secrets", s.withKey(s.handleListSecrets))
	mux.HandleFunc("GET /secrets/{id}", s.withKey(s.handleGetSecret))
	mux.HandleFunc("POST /secrets/{id}", s.withKey(s.handleUpdateSecret))
	mux.HandleFunc("DELETE /secrets/{id}", s.withKey(s.handleDeleteSecret))

	// E2B: volumes (volumes.go).
	mux.HandleFunc("POST /volumes", s.withKey(s.handleCreateVolume))
	mux.HandleFunc("GET /volumes", s.withKey(s.handleListVolumes))
	mux.HandleFunc("GET /volumes/{id}", s.withKey(s.handleGetVolume))
	mux.HandleFunc("DELETE /volumes/{id}", s.withKey(s.handleDeleteVolume))
	// E2B: volume content, authorized by the volume's token (volumecontent.go).
	mux.HandleFunc("GET /volumecontent/{id}/dir", s.volumeHandler(volumeList))
	mux.HandleFunc("POST /volumecontent/{id}/dir", s.volumeHandler(volumeMkdir))
	mux.HandleFunc("GET /volumecontent/{id}/path", s.volumeHandler(volumeStat))
	mux.HandleFunc("PATCH /volumecontent/{id}/path", s.volumeHandler(volumeSetAttrs))
	mux.HandleFunc("DELETE /volumecontent/{id}/path", s.volumeHandler(volumeRemove))
	mux.HandleFunc("GET /volumecontent/{id}/file", s.volumeHandler(volumeRead))
	mux.HandleFunc("PUT /volumecontent/{id}/file", s.volumeHandler(volumeWrite))

	// E2B: lifecycle events, webhooks and sandbox logs (events.go, webhooks.go, logs.go).
	s.eventRoutes(mux)

	// SPACE's own (inspect.go, capabilities.go, move.go, rotate.go).
	mux.HandleFunc("GET /space/v1/workers", s.handleWorkers)
	mux.HandleFunc("GET /space/v1/sandboxes/{id}/executions", s.handleExecutions)
	mux.HandleFunc("POST /space/v1/sandboxes/{id}/capabilities", s.settled(s.handleCapability))
	mux.HandleFunc("POST "+spacev1.PathSignedFilesSandbox, s.handleSignedFilesSandbox)
	mux.HandleFunc("POST /space/v1/sandboxes/{id}/migrate", s.withKey(s.handleMigrate))
	mux.HandleFunc("POST /space/v1/keys/rotate", s.withKey(s.handleRotate))

	// The web dashboard (dashboard.go).
	s.dashboardRoutes(mux)
	// Teams, API keys, access tokens and the OpenAPI document (teams.go).
	s.teamRoutes(mux)

	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, fmt.Errorf("%w: no route for %s %s", errdefs.ErrNotFound, r.Method, r.URL.Path))
	})
	return s.recoverer(mux)
}

// recoverer turns a handler panic into a 500 instead of a dropped connection.
func (s *Server) recoverer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("handler panic", "method", r.Method, "path", r.URL.Path, "panic", fmt.Sprint(v))
				writeJSON(w, http.StatusInternalServerError, e2bapi.Error{Code: 500, Message: "internal error"})
			}
		}()
		h.ServeHTTP(w, r)
	})
}

// settled makes a capability request wait (bounded) while a lifecycle
// operation holds the sandbox, so that the edge's request (or route repair)
// gets the route published by the operation rather than a refusal.
// Capabilities only ever name the published route (Route), never a pending one.
func (s *Server) settled(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if id, err := parseSandboxID(r.PathValue("id")); err == nil {
			if rec, _, err := s.st.GetSandbox(r.Context(), id); err == nil && rec.State.Transitional() {
				_, _ = s.waitSettled(r.Context(), id, capabilityWait)
			}
		}
		h(w, r)
	}
}

// capabilityWait bounds how long a capability request waits for a
// lifecycle operation to end.
const capabilityWait = 30 * time.Second
