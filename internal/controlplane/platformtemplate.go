package controlplane

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/spacesbx/space/api/e2bapi"
	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/store"
)

// Platform templates that run a server (the code interpreter): a create
// runs the template's start command and answers once its ready command
// succeeds, as for a team's built template with a start command. A
// template marked WarmSnapshot (a substrate whose snapshots keep
// processes: a microVM's memory) is started once per team and snapshotted;
// its creates restore that snapshot, so the server and what it warmed up
// (a kernel) are running from the first instant, and the ready command
// succeeds at once.
//
// Warm snapshots are kept per control plane process (not in the store): a
// new process, which may run after workers rebuilt the template's image,
// takes new ones. A create whose restore fails (the image changed under
// the snapshot) drops the snapshot and starts cold.

// platformStart is the start of platform template name (nil when it has
// no start command), in the form a built template's start takes.
func platformStart(name string, t Template) *builtTemplate {
	if t.StartCmd == "" {
		return nil
	}
	return &builtTemplate{build: store.TemplateBuildRecord{TemplateID: name, StartCmd: t.StartCmd, ReadyCmd: t.ReadyCmd,
		Workdir: t.Workdir, User: t.User}}
}

// warmTemplates holds the warm snapshots, by team and template.
type warmTemplates struct {
	mu    sync.Mutex
	slots map[string]*warmSlot
}

type warmSlot struct {
	done   chan struct{} // closed when the build ended
	snapID string
	err    error
}

// warmBuildTimeout bounds one warm snapshot's build (a create, the start
// and ready commands, a snapshot).
const warmBuildTimeout = 5 * time.Minute

// warmSnapshot returns the team's warm snapshot of platform template
// name, building it first when there is none (concurrent creates wait for
// one build; a failed build is not kept, the next create tries again).
func (s *Server) warmSnapshot(ctx context.Context, c caller, name string, t Template) (string, error) {
	key := c.TeamID + "/" + name
	s.warm.mu.Lock()
	if s.warm.slots == nil {
		s.warm.slots = map[string]*warmSlot{}
	}
	slot := s.warm.slots[key]
	owner := slot == nil
	if owner {
		slot = &warmSlot{done: make(chan struct{})}
		s.warm.slots[key] = slot
	}
	s.warm.mu.Unlock()
	if owner {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), warmBuildTimeout)
		t0 := time.Now()
		slot.snapID, slot.err = s.buildWarm(bctx, c, name, t)
		cancel()
		if slot.err != nil {
			s.dropWarm(c.TeamID, name, slot)
			s.log.Warn("platform template: warm snapshot failed; creates start the server themselves", "template", name, "team", c.TeamID, "err", slot.err)
		} else {
			s.log.Info("platform template: warm snapshot taken", "template", name, "team", c.TeamID, "snapshot", slot.snapID, "took", time.Since(t0).Round(time.Millisecond))
		}
		close(slot.done)
	}
	select {
	case <-slot.done:
		return slot.snapID, slot.err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// dropWarm forgets slot (when it is still the team's slot of name) and
// removes its snapshot.
func (s *Server) dropWarm(team, name string, slot *warmSlot) {
	s.warm.mu.Lock()
	if s.warm.slots[team+"/"+name] == slot {
		delete(s.warm.slots, team+"/"+name)
	}
	s.warm.mu.Unlock()
	if slot.snapID == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if snap, err := s.st.GetSnapshot(ctx, slot.snapID); err == nil {
		if err := s.dropSnapshot(ctx, snap); err != nil {
			s.log.Warn("platform template: removing a stale warm snapshot", "template", name, "snapshot", slot.snapID, "err", err)
		}
	}
}

// buildWarm creates a sandbox of name, starts its server, snapshots it
// with the server running and removes it.
func (s *Server) buildWarm(ctx context.Context, c caller, name string, t Template) (string, error) {
	if s.cfg.SandboxURL == "" {
		return "", fmt.Errorf("%w: template %s has a start command but this control plane has no sandbox URL", errdefs.ErrUnavailable, name)
	}
	timeout := int32(warmBuildTimeout / time.Second)
	p, err := s.validateCreate(c, e2bapi.NewSandbox{TemplateID: name, Timeout: &timeout}, true)
	if err != nil {
		return "", err
	}
	p.Metadata = map[string]string{"space.platform-template": name}
	rec, err := s.createSandbox(ctx, c, p)
	if err != nil {
		return "", err
	}
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := s.killSandbox(kctx, rec.ID, c.TeamID, "warm template snapshot taken", func(store.SandboxRecord) error { return nil }); err != nil {
			s.log.Warn("platform template: removing the warm-up sandbox", "sandbox", rec.ID, "err", err)
		}
	}()
	if err := s.startTemplate(ctx, platformStart(name, t), rec); err != nil {
		return "", err
	}
	snap, err := s.snapshotSandbox(ctx, rec.ID, c.TeamID, "")
	if err != nil {
		return "", err
	}
	return snap.ID, nil
}

// createWarm creates a sandbox of platform template p.Template from the
// team's warm snapshot; without one (its build failed) or when its
// restore fails (the snapshot is then dropped), a plain create. The
// caller runs the start (whose ready check succeeds at once on a
// restored sandbox).
func (s *Server) createWarm(ctx context.Context, c caller, p createParams) (store.SandboxRecord, error) {
	name := p.Template
	snap, err := s.warmSnapshot(ctx, c, name, p.Spec)
	if err == nil {
		wp := p
		wp.RestoreSnapshot = snap
		rec, err := s.createSandbox(ctx, c, wp)
		if err == nil || errors.Is(err, errdefs.ErrInvalid) || errors.Is(err, errdefs.ErrDenied) {
			return rec, err
		}
		s.log.Warn("platform template: restoring the warm snapshot failed; dropping it and creating cold", "template", name, "snapshot", snap, "err", err)
		s.warm.mu.Lock()
		slot := s.warm.slots[c.TeamID+"/"+name]
		s.warm.mu.Unlock()
		if slot != nil && slot.snapID == snap {
			s.dropWarm(c.TeamID, name, slot)
		}
	}
	return s.createSandbox(ctx, c, p)
}

// restartPlatformServer starts the server of a platform template's
// sandbox again after a move that restarted its processes (ns), before
// the move is answered; a failure is logged (the sandbox itself moved).
func (s *Server) restartPlatformServer(ctx context.Context, rec store.SandboxRecord) {
	bt := platformStart(rec.TemplateID, s.cfg.Templates[rec.TemplateID])
	if bt == nil {
		return
	}
	if err := s.startTemplate(context.WithoutCancel(ctx), bt, rec); err != nil {
		s.log.Warn("platform template: restarting the server after a move failed", "sandbox", rec.ID, "template", rec.TemplateID, "err", err)
	}
}
