package controlplane

// autoResume (E2B's lifecycle.autoResume): a sandbox created with
// autoResume {enabled: true} that is paused is resumed by traffic. The
// edge asks for a capability for every request it cannot serve from its
// cache (and again, as route repair, when node-api answers that the
// execution is frozen); issueCapability, after it has authorized the
// caller, resumes such a sandbox here and then issues the capability for
// the execution the resume published, never for anything else. Without
// autoResume a paused sandbox keeps today's answer (409 paused, which the
// edge turns into E2B's 502).
//
// One resume per sandbox: the first request starts it, concurrent ones
// (every purpose, every caller) wait for the same resume, each at most
// autoResumeWait; a resume started by another control plane, or by the
// API, is waited for through the record's lifecycle operation.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// autoResumeWait bounds how long a request waits for the resume it
// triggered or joined. The resume itself runs on (it is never abandoned
// half-way); a request that gives up gets the paused answer and its
// retry finds the sandbox running.
const autoResumeWait = 60 * time.Second

// autoResumes are the resumes in flight, by sandbox id.
type autoResumes struct {
	mu sync.Mutex
	m  map[string]*resumeFlight
	// started counts resumes started (AutoResumesStarted).
	started int
}

// AutoResumesStarted is how many automatic resumes this control plane
// has started (platform tests: concurrent requests start one).
func (s *Server) AutoResumesStarted() int {
	s.resumes.mu.Lock()
	defer s.resumes.mu.Unlock()
	return s.resumes.started
}

type resumeFlight struct {
	done chan struct{}
	err  error
}

// runnable returns the record a capability is issued from: a record in
// a lifecycle operation is waited for (bounded, capabilityWait; the
// settled wrapper's check at the request's start can miss an operation
// that begins just after it, such as the resume another request
// triggered), and a paused one with AutoResume is resumed (autoResume).
func (s *Server) runnable(ctx context.Context, rec store.SandboxRecord) (store.SandboxRecord, error) {
	if rec.State.Transitional() {
		cur, err := s.waitSettled(ctx, rec.ID, capabilityWait)
		if err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				return rec, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, rec.ID)
			}
			return rec, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
		}
		rec = cur
	}
	if rec.State == store.StatePaused && rec.AutoResume {
		return s.autoResume(ctx, rec)
	}
	return rec, nil
}

// autoResume resumes rec (paused, AutoResume set), or joins the resume in
// flight, and returns the record after it. rec's caller is authorized.
func (s *Server) autoResume(ctx context.Context, rec store.SandboxRecord) (store.SandboxRecord, error) {
	id := rec.ID
	s.resumes.mu.Lock()
	if s.ctx.Err() != nil {
		s.resumes.mu.Unlock()
		return rec, fmt.Errorf("%w: control plane shutting down", errdefs.ErrUnavailable)
	}
	if s.resumes.m == nil {
		s.resumes.m = map[string]*resumeFlight{}
	}
	f := s.resumes.m[id]
	if f == nil {
		f = &resumeFlight{done: make(chan struct{})}
		s.resumes.m[id] = f
		s.resumes.started++
		timeout := rec.ResumeTimeout
		if timeout <= 0 {
			timeout = s.cfg.DefaultTimeout
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.log.Info("auto-resuming paused sandbox on traffic", "sandbox", id)
			_, _, err := s.resumeSandbox(s.ctx, id, rec.TeamID, resumeOpts{Timeout: timeout})
			s.resumes.mu.Lock()
			f.err = err
			delete(s.resumes.m, id)
			s.resumes.mu.Unlock()
			close(f.done)
		}()
	}
	s.resumes.mu.Unlock()

	t := time.NewTimer(autoResumeWait)
	defer t.Stop()
	select {
	case <-f.done:
	case <-ctx.Done():
		return rec, ctx.Err()
	case <-t.C:
		return rec, fmt.Errorf("%w: sandbox %s is paused; its automatic resume is still under way, retry", errSandboxPaused, id)
	}
	// Whatever this resume's outcome (another control plane's or the
	// API's resume may have won the record), the record says where the
	// sandbox is now.
	cur, err := s.waitSettled(ctx, id, autoResumeWait)
	if err != nil {
		if errors.Is(err, errdefs.ErrNotFound) {
			return rec, fmt.Errorf("%w: sandbox %s", errdefs.ErrNotFound, id)
		}
		return rec, fmt.Errorf("%w: %v", errdefs.ErrUnavailable, err)
	}
	if cur.State != store.StateRunning {
		if f.err != nil {
			s.log.Warn("automatic resume failed", "sandbox", id, "err", f.err)
		}
		if cur.State.Terminal() {
			return cur, fmt.Errorf("%w: sandbox %s was %s", errdefs.ErrNotFound, id, cur.State)
		}
		return cur, fmt.Errorf("%w: sandbox %s is %s; its automatic resume failed", errSandboxPaused, id, cur.State)
	}
	return cur, nil
}
