package nodeapi

import (
	"context"
	"net/http"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/identity"
)

// agentLog answers the newest lines of an execution's agent log.
func (s *Server) agentLog() http.HandlerFunc {
	return control(s, func(q *spacev1.LifecycleRequest) identity.Route { return q.Route },
		func(ctx context.Context, q *spacev1.LifecycleRequest) (any, error) {
			return s.mgr.AgentLog(ctx, q.Route)
		})
}
