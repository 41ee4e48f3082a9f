package controlplane

import (
	"net/http"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/store"
)

// handleMetrics serves GET /sandboxes/{id}/metrics?start=&end= (E2B's
// Sandbox.getMetrics), authorized like GET /sandboxes/{id}: the owner
// team's API key; unknown, killed and foreign sandboxes are 404.
//
// The samples come from the sandbox's worker, which samples every
// execution every 5 s and keeps an hour of them (sbxmanager sampler.go;
// node call NodePathMetricsRange): the answer is those taken in
// [start, end] (Unix seconds, inclusive; open when absent), oldest first.
// History belongs to the execution: after a resume on another worker or a
// move it starts again. A running sandbox whose worker cannot answer is an
// error; a paused sandbox reports its samples (frozen: CPU ~0) when its
// worker still holds it and an empty list otherwise; a sandbox in the
// middle of a lifecycle operation answers an empty list. diskTotal is the
// worker's figure when it has one, otherwise the template's nominal
// DiskSizeMB, and never less than diskUsed.
func (s *Server) handleMetrics(w http.ResponseWriter, r *http.Request, c caller) {
	id, err := parseSandboxID(r.PathValue("id"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	win, err := parseWindow(r.URL.Query())
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rec, err := s.getSandbox(r.Context(), c, id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	out := []e2bapi.SandboxMetric{}
	if rec.State == store.StateRunning || rec.State == store.StatePaused {
		samples, err := s.node.metricsRange(r.Context(), s.nodeURL(r.Context(), rec), rec.Route, win, 0)
		switch {
		case err != nil && rec.State == store.StateRunning:
			s.writeError(w, r, err)
			return
		case err != nil:
			s.log.Debug("metrics of a paused sandbox unavailable", "sandbox", id, "err", err)
		default:
			for _, m := range samples {
				if win.contains(m.Timestamp) {
					out = append(out, s.metric(rec, m))
				}
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
