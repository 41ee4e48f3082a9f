package controlplane

import (
	"net/http"

	"github.com/spacesbx/space/internal/dashboard"
)

// dashboardRoutes mounts the web dashboard (internal/dashboard): static,
// unauthenticated pages whose API calls carry the key or token the user
// typed, to this same listener. The mux redirects "/dashboard" to it.
func (s *Server) dashboardRoutes(mux *http.ServeMux) {
	mux.Handle(dashboard.Prefix, dashboard.Handler())
}
