package edge

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
)

// Several control planes: Config.ControlPlaneURL may name several
// space-api replicas, comma-separated. Every call to the control plane
// (capability issuance and repair, signed-URL lookups) goes to the replica
// that answered last and, when that one cannot answer (connection refused
// or reset, a timeout, or 502/503/504: down, restarting, or behind a proxy
// that found it down), to the next one in turn. A replica's refusal (4xx)
// or any other answer is final. The calls are safe to repeat: issuing a
// capability twice changes nothing.

// controlPlaneURLs splits a ControlPlaneURL value into its URLs (trailing
// slashes and blanks trimmed; empty entries dropped).
func controlPlaneURLs(v string) []string {
	var out []string
	for _, u := range strings.Split(v, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			out = append(out, u)
		}
	}
	return out
}

func validControlPlaneURLs(v string) error {
	us := controlPlaneURLs(v)
	if len(us) == 0 {
		return fmt.Errorf("edge: ControlPlaneURL is required")
	}
	for _, s := range us {
		if u, err := url.Parse(s); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("edge: ControlPlaneURL %q is not an http(s) URL", s)
		}
	}
	return nil
}

// controlPlanes are the replicas and the one to try first.
type controlPlanes struct {
	urls []string
	pref atomic.Int32
}

// failover reports whether a response means the replica could not answer.
func failover(code int) bool {
	return code == http.StatusBadGateway || code == http.StatusServiceUnavailable || code == http.StatusGatewayTimeout
}

// cpDo sends the request build makes for one replica's base URL, trying
// the replicas in turn (see above). It returns the first final answer, or
// the last replica's answer or error when none could answer. ctx ending
// stops the tries.
func (e *Edge) cpDo(ctx context.Context, build func(base string) (*http.Request, error)) (*http.Response, error) {
	cps := e.cps
	n := len(cps.urls)
	first := int(cps.pref.Load())
	var lastErr error
	for i := range n {
		idx := (first + i) % n
		req, err := build(cps.urls[idx])
		if err != nil {
			return nil, err
		}
		res, err := e.cfg.ControlPlaneClient.Do(req)
		if ctx.Err() != nil {
			if err == nil {
				res.Body.Close()
			}
			return nil, ctx.Err()
		}
		last := i == n-1
		if err == nil && (!failover(res.StatusCode) || last) {
			if i > 0 && !failover(res.StatusCode) {
				cps.pref.Store(int32(idx))
			}
			return res, nil
		}
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, maxControlResponse))
			res.Body.Close()
			err = fmt.Errorf("status %d", res.StatusCode)
		}
		lastErr = err
		if n > 1 {
			e.metrics.cpFailovers.Inc()
			e.log.Warn("control plane replica unavailable; trying the next", "control_plane", cps.urls[idx], "err", err)
		}
	}
	return nil, lastErr
}
