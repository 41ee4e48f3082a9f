package controlplane

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// handleMetrics serves GET /sandboxes/{id}/metrics (E2B's
// Sandbox.getMetrics), authorized like GET /sandboxes/{id}: the owner
// team's API key; unknown, killed and foreign sandboxes are 404.
//
// SPACE keeps no metrics history: the answer is one sample taken now by
// the sandbox's worker (node call NodePathMetrics), or an empty list when
// that sample falls outside the optional start/end window (Unix seconds,
// inclusive). A running sandbox whose worker cannot answer is an error; a
// paused sandbox reports its frozen usage (CPU ~0) when its worker still
// holds it and an empty list otherwise; a sandbox in the middle of a
// lifecycle operation answers an empty list. diskTotal is the worker's
// figure when it has one, otherwise the template's nominal DiskSizeMB (the
// ns substrate has no disk quota), and never less than diskUsed.
func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	var window [2]int64 // start, end; 0: open
	for i, k := range []string{"start", "end"} {
		if v := r.URL.Query().Get(k); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				s.writeError(w, r, fmt.Errorf("%w: %s must be Unix seconds", errdefs.ErrInvalid, k))
				return
			}
			window[i] = n
		}
	}
	rec, err := s.getSandbox(r.Context(), c, id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := []e2bapi.SandboxMetric{}
	if rec.State == store.StateRunning || rec.State == store.StatePaused {
		m, err := s.node.metrics(r.Context(), s.nodeURL(r.Context(), rec), rec.Route)
		switch {
		case err != nil && rec.State == store.StateRunning:
			s.writeError(w, r, err)
			return
		case err != nil:
			s.log.Debug("metrics of a paused sandbox unavailable", "sandbox", id, "err", err)
		default:
			ts := m.Timestamp.Unix()
			if (window[0] == 0 || ts >= window[0]) && (window[1] == 0 || ts <= window[1]) {
				out = append(out, s.metric(rec, m))
			}
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) metric(rec store.SandboxRecord, m spacev1.MetricsResponse) e2bapi.SandboxMetric {
	if m.Timestamp.IsZero() {
		m.Timestamp = s.now()
	}
	disk := m.DiskTotal
	if disk <= 0 {
		disk = int64(rec.DiskSizeMB) << 20
	}
	disk = max(disk, m.DiskUsed)
	return e2bapi.SandboxMetric{
		Timestamp: m.Timestamp.UTC(), TimestampUnix: m.Timestamp.Unix(),
		CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct,
		MemUsed: m.MemUsed, MemTotal: m.MemTotal, MemCache: m.MemCache,
		DiskUsed: m.DiskUsed, DiskTotal: disk,
	}
}
