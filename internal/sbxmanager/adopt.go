package sbxmanager

// Re-adoption at start. Sandboxes and their spaced-hosts outlive the
// worker process (a restart, an upgrade, a crash), so a new manager first
// takes back the activations its records name, each only after the same
// checks a new activation passes:
//
//  1. the substrate adopts the instance (substrate.Adopter): its init or
//     VMM by pidfd and start time, executable, cgroups, guest socket, and
//     it takes back the instance's uid range and layer;
//  2. the recorded spaced-host is exactly the process launched for it
//     (pid, start time, executable device+inode and SHA-256), and every
//     connection to it is verified as before (VerifyPeer);
//  3. a request through that spaced-host reaches the guest, which makes
//     spaced-host run its five guest checks on a new guest connection,
//     and the guest reports this very execution (Space-Execution and
//     /_space/identity). A paused instance is thawed for that probe and
//     frozen again.
//
// An activation that passes is served again as it was: same generation,
// execution and activation, processes and pids kept. Anything that fails
// a check is never served: its leftovers are ended (Stop, or Reclaim when
// nothing could be adopted) and the execution is recovered as a new one
// from its files (Lost), as for a worker whose sandboxes died with it.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/spacesbx/space/api/spacev1"
	"github.com/spacesbx/space/internal/bridge"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/identity"
	"github.com/spacesbx/space/internal/procid"
	"github.com/spacesbx/space/internal/substrate"
)

// managerFileName is the file in the state directory that names the
// current manager process to the spaced-hosts it serves through.
const managerFileName = "manager"

func (m *Manager) managerFile() string { return filepath.Join(m.cfg.StateDir, managerFileName) }

// adoptParallel bounds concurrent adoptions at start.
const adoptParallel = 8

// StartReport counts what a manager found at start among the executions
// on record.
type StartReport struct {
	// Adopted: running (or paused) activations served again as they were.
	Adopted int
	// Reclaimed: activations whose processes were gone or failed a check;
	// their leftovers were ended and they are reported lost, for recovery
	// as new executions from their files.
	Reclaimed int
	// Unreclaimed: leftovers that could not be ended; neither served nor
	// recovered (their files may still be written).
	Unreclaimed int
	// Retired: records of executions already replaced (never served).
	Retired int
}

// StartReport returns what New found among the executions on record.
func (m *Manager) StartReport() StartReport { return m.startReport }

// adoptAll takes back or reclaims every execution on record (see the top
// of this file). Called once, from New, before anything is served.
func (m *Manager) adoptAll() {
	m.unreclaimed = map[string]bool{}
	type result struct {
		rec record
		act *activation
		err error
	}
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		out []result
		sem = make(chan struct{}, adoptParallel)
	)
	for _, rec := range m.records {
		if rec.Retired {
			m.startReport.Retired++
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			act, err := m.adopt(rec)
			mu.Lock()
			out = append(out, result{rec, act, err})
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, res := range out {
		r := res.rec.Route
		if res.err == nil {
			// The proxy is new with this process: the policy goes back
			// in force before the sandbox is served (until then its
			// link gets nothing out).
			res.act.link = res.rec.Link
			if err := m.applyNetwork(res.rec); err != nil {
				m.log.Error("egress policy of an adopted execution not in force; it has no way out", "sandbox", r.SandboxID, "generation", r.Generation, "err", err)
			}
			res.act.awaitingView.Store(true)
			m.active[r.SandboxID] = res.act
			m.watchers.Add(1)
			go m.watchExit(res.act)
			m.metrics.activations.Inc()
			m.startReport.Adopted++
			m.audit.lost("adopted", r, nil)
			m.log.Info("execution re-adopted", "sandbox", r.SandboxID, "generation", r.Generation,
				"execution", r.ExecutionID, "paused", res.act.paused.Load())
			continue
		}
		m.log.Warn("execution not adopted; ending its leftovers for recovery", "sandbox", r.SandboxID,
			"generation", r.Generation, "err", res.err)
		m.audit.lost("not-adopted", r, res.err)
		if err := m.reclaim(res.rec); err != nil {
			m.unreclaimed[r.SandboxID] = true
			m.startReport.Unreclaimed++
			m.log.Error("reclaiming a lost execution failed", "sandbox", r.SandboxID, "generation", r.Generation, "err", err)
			continue
		}
		m.startReport.Reclaimed++
		m.log.Info("lost execution reclaimed", "sandbox", r.SandboxID, "generation", r.Generation)
	}
	m.sweep()
	m.sweepLinks()
	m.log.Info("executions on record at start", "adopted", m.startReport.Adopted, "reclaimed", m.startReport.Reclaimed,
		"unreclaimed", m.startReport.Unreclaimed, "retired", m.startReport.Retired)
}

// reclaim ends what is left of rec's activation (substrate.Reclaimer) and
// audits it.
func (m *Manager) reclaim(rec record) error {
	rc, ok := m.subs[rec.Route.Substrate].(substrate.Reclaimer)
	if !ok {
		m.releaseLink(rec)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.StartTimeout)
	defer cancel()
	err := rc.Reclaim(ctx, rec.Route, rec.Dir)
	m.audit.lost("reclaimed", rec.Route, err)
	if err == nil {
		m.releaseLink(rec)
	}
	return err
}

// sweep lets each substrate that can (substrate.Sweeper) end the
// sandboxes no record names: started by a worker that died before it
// wrote their record.
func (m *Manager) sweep() {
	keep := map[string]bool{}
	for _, rec := range m.records {
		if !rec.Retired {
			keep[rec.Route.SandboxID+"-"+rec.Route.ActivationID] = true
		}
	}
	for name, sub := range m.subs {
		sw, ok := sub.(substrate.Sweeper)
		if !ok {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), m.cfg.StartTimeout)
		n, err := sw.Sweep(ctx, func(cg string) bool { return keep[cg] })
		cancel()
		if err != nil {
			m.log.Error("sweeping unrecorded sandboxes failed", "substrate", name, "err", err)
		}
		if n > 0 {
			m.log.Warn("ended sandboxes no record names (started by a worker that died before recording them)", "substrate", name, "count", n)
		}
	}
}

// adopt takes back rec's activation, or returns why it cannot be served;
// on error it has stopped whatever it verified as that activation's (the
// instance it adopted, the recorded spaced-host), and nothing else.
func (m *Manager) adopt(rec record) (*activation, error) {
	r := rec.Route
	ad, ok := m.subs[r.Substrate].(substrate.Adopter)
	if !ok || len(rec.Adopt) == 0 || rec.Host.PID <= 0 {
		return nil, fmt.Errorf("%w: no adoption state on record", substrate.ErrNotAdoptable)
	}
	hh, hostErr := openHost(rec)
	stopHost := func() {
		if hh != nil {
			stopAdoptedHost(hh)
			hh.Close()
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.StartTimeout)
	defer cancel()
	spec := substrate.Spec{Route: r, Template: rec.Template, Dir: rec.Dir, AgentPath: m.cfg.AgentPath, Limits: substrateLimits(rec.Limits)}
	inst, err := ad.Adopt(ctx, spec, rec.Adopt)
	if err != nil {
		stopHost()
		return nil, fmt.Errorf("adopt instance: %w", err)
	}
	var act *activation
	if err = hostErr; err == nil {
		act, err = m.adoptBridge(ctx, rec, inst, hh)
	}
	if err != nil {
		stopHost()
		sctx, scancel := context.WithTimeout(context.Background(), 15*time.Second)
		if serr := inst.Stop(sctx); serr != nil {
			err = errors.Join(err, fmt.Errorf("stop the adopted instance: %w", serr))
		}
		scancel()
		return nil, err
	}
	return act, nil
}

// openHost opens the spaced-host rec names if it is exactly the recorded
// process (pid, start time, executable device+inode and SHA-256);
// otherwise it returns an error and no handle: another process under that
// pid is not ours to stop.
func openHost(rec record) (*procid.Handle, error) {
	hh, err := procid.Open(rec.Host.PID)
	if err != nil {
		return nil, fmt.Errorf("%w: spaced-host: %v", substrate.ErrNotAdoptable, err)
	}
	if got := hh.Process(); got != rec.Host {
		hh.Close()
		return nil, fmt.Errorf("%w: spaced-host pid %d is not the recorded process (start %d/%d, exe %d:%d/%d:%d, sha256 %.12s/%.12s)",
			substrate.ErrNotAdoptable, rec.Host.PID, got.StartTime, rec.Host.StartTime, got.ExeDev, got.ExeIno, rec.Host.ExeDev, rec.Host.ExeIno,
			got.ExeSHA256, rec.Host.ExeSHA256)
	}
	return hh, nil
}

// stopAdoptedHost ends a spaced-host this process did not launch: SIGKILL
// through its pidfd, and waits (bounded) until it has exited.
func stopAdoptedHost(hh *procid.Handle) {
	exited, err := hh.Exited()
	if hh.Signal(syscall.SIGKILL) != nil || err != nil {
		return
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
	}
}

// adoptBridge takes over the verified spaced-host hh of rec for inst and
// probes the guest through it. On error the caller stops both.
func (m *Manager) adoptBridge(ctx context.Context, rec record, inst substrate.Instance, hh *procid.Handle) (*activation, error) {
	r := rec.Route
	exited, err := hh.Exited()
	if err != nil {
		return nil, fmt.Errorf("%w: spaced-host: %v", substrate.ErrNotAdoptable, err)
	}
	// As for a bridge this manager launched: the handle is closed once
	// the process is gone, so every later check fails closed.
	hostDone := make(chan struct{})
	go func() { <-exited; hh.Close(); close(hostDone) }()
	act := m.newActivation(inst, hh, hostDone, filepath.Join(rec.Dir, "host.sock"))
	fail := func(err error) (*activation, error) {
		act.cancel()
		act.tr.CloseIdleConnections()
		return nil, err
	}
	if m.caps(r).Netns {
		if act.gwState, err = recordGateway(inst, rec.Dir); err != nil {
			return fail(fmt.Errorf("%w: gateway state: %v", substrate.ErrNotAdoptable, err))
		}
	} else if m.caps(r).Tap {
		if act.gwState, err = m.recordTapGateway(inst, rec.Dir, rec.Link); err != nil {
			return fail(fmt.Errorf("%w: gateway state: %v", substrate.ErrNotAdoptable, err))
		}
	}
	paused := false
	if a, ok := inst.(substrate.Adoptable); ok {
		paused = a.Paused()
	}
	if paused {
		// A frozen guest answers nothing: thaw it for the probe only.
		if err := inst.Resume(ctx); err != nil {
			return fail(fmt.Errorf("%w: thaw for the probe: %v", substrate.ErrNotAdoptable, err))
		}
	}
	perr := m.probe(ctx, act)
	if paused {
		if err := inst.Pause(ctx); err != nil {
			return fail(errors.Join(perr, fmt.Errorf("freeze again after the probe: %w", err)))
		}
		act.paused.Store(true)
	}
	if perr != nil {
		return fail(perr)
	}
	return act, nil
}

// probe asks the guest, through the activation's spaced-host, which
// execution it is: spaced-host verifies the guest connection it opens for
// it (path inode, listener, sock_diag, peer process, reported identity)
// and stamps its own execution on the response.
func (m *Manager) probe(ctx context.Context, act *activation) error {
	r := act.route
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://spaced-host"+identityPath, nil)
	if err != nil {
		return err
	}
	resp, err := act.tr.RoundTrip(req)
	if err != nil {
		return fmt.Errorf("%w: probe through spaced-host: %v", substrate.ErrNotAdoptable, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: probe answered %d: %.200s", substrate.ErrNotAdoptable, resp.StatusCode, body)
	}
	if got := resp.Header.Get(spacev1.HeaderExecution); got != r.ExecutionLabel() {
		return fmt.Errorf("%w: spaced-host serves execution %q, not %q", substrate.ErrNotAdoptable, got, r.ExecutionLabel())
	}
	var id identity.Route
	if err := json.Unmarshal(body, &id); err != nil || id != r {
		return fmt.Errorf("%w: guest reports %s, not %s", substrate.ErrNotAdoptable, body, r)
	}
	return nil
}

// ConfirmAdopted lets requests reach the activations adopted at start:
// the caller has applied the control plane's view (retired what it no
// longer runs). Until then they answer 503 with a Retry-After.
func (m *Manager) ConfirmAdopted() {
	m.mu.RLock()
	defer m.mu.RUnlock()
	for _, a := range m.active {
		a.awaitingView.Store(false)
	}
}

// awaitingViewError is the answer to a request for an adopted activation
// before ConfirmAdopted.
func awaitingViewError(sandbox string) error {
	return errdefs.WithRetryAfter(fmt.Errorf("%w: execution of %s was re-adopted after a worker restart and is served once the control plane's view is applied",
		errdefs.ErrUnavailable, sandbox), time.Second)
}

// identityPath is where the guest reports its identity (bridge's check 5).
const identityPath = bridge.IdentityPath

// Detach stops serving and leaves every sandbox running for the next
// manager to adopt (a worker restart or upgrade): streams end, the
// bridges and instances are let go of, records are kept. Instances of a
// substrate without adoption are stopped, as Close does. Close must not
// be called after it.
func (m *Manager) Detach() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	close(m.sampleStop) // sampler.go
	acts := make([]*activation, 0, len(m.active))
	for _, a := range m.active {
		acts = append(acts, a)
	}
	clear(m.active)
	m.mu.Unlock()
	for _, a := range acts {
		ad, ok := a.inst.(substrate.Adoptable)
		if !ok {
			m.stopActivation(a, "shutdown (not adoptable)")
			continue
		}
		a.cancel()
		a.stopGateway()
		a.tr.CloseIdleConnections()
		ad.Detach()
		m.log.Info("activation left running for the next worker", "sandbox", a.route.SandboxID, "generation", a.route.Generation)
	}
	m.watchers.Wait()
	return m.closeFiles()
}
