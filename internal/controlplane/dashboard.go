package controlplane

import (
	"net/http"

	"github.com/spacesbx/space/internal/dashboard"
)

// dashboardRoutes mounts the web dashboard (internal/dashboard): static,
// unauthenticated pages whose API calls carry the key or token the user
// typed, to this same listener.
func (s *Server) dashboardRoutes(mux *http.ServeMux) {
	h := dashboard.Handler()
	mux.Handle(dashboard.Prefix, h)
	mux.Handle("/dashboard", h)
}
